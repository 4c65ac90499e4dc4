"""KVPrewarm: an ingestion transformation that pre-computes each node's KV for the query engine's prompt."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_index.core.prompts import BasePromptTemplate, SelectorPromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent
from llama_index.llms.kvboost.base import KVBoost
from llama_index.llms.kvboost.messages import to_chat_messages
from pydantic import Field, PrivateAttr, model_validator

if TYPE_CHECKING:
    from kvboost_rag import PrewarmReport, Segment

KEY_METADATA = "kvboost_key"
"""Node metadata key of the stored KV's prefix key (hidden from LLM and embedding text)."""

_MARKER = "\x02kvboost-context\x03"


class KVPrewarm(TransformComponent):
    """Pre-warm each node's KV at indexing time, after the text that precedes the context in the QA prompt.

    Response synthesizers paste node texts (``node.get_content(MetadataMode.LLM)``)
    into ``text_qa_template`` after a fixed opening (system prompt, "Context
    information is below..."). KVPrewarm renders that opening exactly as
    :class:`KVBoost` will at query time, stores the KV of ``opening + node text``
    for every node, and records the node's tokens so that blend mode finds them
    anywhere in later prompts. A query whose context starts with a pre-warmed node
    reads its KV from the store (exact mode); with ``reuse="blend"`` every retrieved
    pre-warmed node is read, wherever the template puts it. Each node gets
    ``metadata["kvboost_key"]`` (excluded from LLM and embedding text): the key of
    its stored KV.

    Use it in an ``IngestionPipeline`` or ``VectorStoreIndex.from_documents(...,
    transformations=[...])``, after the node parser. When the pipeline's cache
    skips it, the KV and the registered texts are already in ``llm``'s store
    (with ``store_dir`` set); with a memory-only store the cache never skips it.

    Example:
        .. code-block:: python

            from llama_index.core import VectorStoreIndex
            from llama_index.core.node_parser import SentenceSplitter
            from llama_index.llms.kvboost import KVBoost, KVPrewarm

            llm = KVBoost(store_dir="./kv")
            index = VectorStoreIndex.from_documents(
                documents, embed_model=embed_model,
                transformations=[SentenceSplitter(chunk_size=512), KVPrewarm(llm=llm)],
            )
            index.as_query_engine(llm=llm).query("...")
    """

    llm: KVBoost = Field(description="The LLM the query engine will use (its engine and store are shared).")
    template: BasePromptTemplate | None = Field(
        default=None, description="The query engine's text_qa_template; None: LlamaIndex's default."
    )
    context_variable: str = Field(
        default="context_str", description="The template variable the nodes go into."
    )
    template_variables: dict[str, str] = Field(
        default_factory=dict, description="Values of template variables that come before the context."
    )
    pin: bool = Field(default=False, description="Protect the stored KV from eviction.")
    _store_identity: str = PrivateAttr()

    @classmethod
    def class_name(cls) -> str:
        return "KVPrewarm"

    @model_validator(mode="after")
    def _check_template(self) -> KVPrewarm:
        template = self.selected_template()
        names = {*template.template_vars, *(template.template_var_mappings or {})}
        if self.context_variable not in names:
            msg = (
                f"the template has no {{{self.context_variable}}} variable (it has {sorted(names)}); "
                "pass the template the query engine uses, or set context_variable"
            )
            raise ValueError(msg)
        return self

    def model_post_init(self, context: Any) -> None:
        # The ingestion cache skips a transformation whose to_dict() and input nodes it has seen.
        # A store on disk still holds the KV then; a memory-only store does not outlive the
        # process, so it gets an identity of its own and the cache never matches it. A Redis tier
        # outlives it too; its URL (which may hold a password) enters only as a digest.
        store, redis_url = self.llm.store_dir, self.llm.redis_url
        if store:
            self._store_identity = str(Path(store).expanduser().resolve())
        elif redis_url:
            self._store_identity = "redis-" + hashlib.sha256(redis_url.encode()).hexdigest()[:16]
        else:
            self._store_identity = f"memory-{uuid.uuid4().hex}"

    def to_dict(self, **kwargs: Any) -> dict[str, Any]:
        return super().to_dict(**kwargs) | {"kv_store": self._store_identity}

    def selected_template(self) -> BasePromptTemplate:
        """The QA template as the query engine will pick it for ``llm``."""
        template = self.template or DEFAULT_TEXT_QA_PROMPT_SEL
        return template.select(llm=self.llm) if isinstance(template, SelectorPromptTemplate) else template

    def prefix(self) -> list[Segment]:
        """The segments that precede the context in the rendered QA prompt."""
        from kvboost_rag.canonical import segments_before

        template = self.selected_template()
        variables = {v: "" for v in template.template_vars}
        variables |= self.template_variables | {self.context_variable: _MARKER}
        # The same rendering path as LLM.predict: format, output parser, system prompt.
        messages = self.llm._get_messages(template, **variables)
        segments = self.llm.engine.canonicalizer.segments_of(to_chat_messages(messages))
        return segments_before(segments, _MARKER)

    def prewarm(self, nodes: Sequence[BaseNode]) -> PrewarmReport:
        """Pre-warm ``nodes`` and record their keys; returns the engine's report."""
        texts = []
        for node in nodes:
            # Synthesizers strip each node's text before packing it into the prompt.
            text = node.get_content(metadata_mode=MetadataMode.LLM).strip()
            if not text:
                msg = f"node {node.node_id} has no text to pre-warm; drop empty nodes before KVPrewarm"
                raise ValueError(msg)
            texts.append(text)
        report = self.llm.engine.prewarm(
            texts, prefix=self.prefix(), pin=self.pin, cache_salt=self.llm.cache_salt
        )
        for node, key in zip(nodes, report.keys, strict=True):
            node.metadata[KEY_METADATA] = key
            for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
                if KEY_METADATA not in excluded:
                    excluded.append(KEY_METADATA)
        return report

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        self.prewarm(nodes)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        await asyncio.to_thread(self.prewarm, nodes)
        return nodes
