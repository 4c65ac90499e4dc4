"""Documents as prompt segments, and pre-warming them for a chain's prompt template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.documents import Document

if TYPE_CHECKING:
    from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate

    from langchain_kvboost.chat_models import ChatKVBoost

_MARKER = "\x02kvboost-context\x03"


def documents_to_blocks(documents: Sequence[Document], *, separator: str = "\n\n") -> list[dict[str, str]]:
    """Text content blocks, one per document (plus separators), so each document keeps its identity.

    >>> documents_to_blocks([Document(page_content="a"), Document(page_content="b")])
    [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': '\\n\\n'}, {'type': 'text', 'text': 'b'}]
    """
    blocks: list[dict[str, str]] = []
    for i, doc in enumerate(documents):
        if i and separator:
            blocks.append({"type": "text", "text": separator})
        blocks.append({"type": "text", "text": doc.page_content})
    return blocks


def format_documents(documents: Sequence[Document], separator: str = "\n\n") -> str:
    """The usual ``"\\n\\n".join(page_content)`` context string of a RAG chain."""
    return separator.join(d.page_content for d in documents)


def prewarm_documents(
    llm: ChatKVBoost,
    documents: Sequence[Document],
    prompt: ChatPromptTemplate,
    *,
    context_variable: str = "context",
    pin: bool = False,
    document_prompt: BasePromptTemplate | None = None,
    **other_variables: Any,
) -> Any:
    """Pre-warm each document right after the exact text that precedes ``{context}`` in ``prompt``.

    The prompt is rendered into segments, exactly as :class:`ChatKVBoost` renders
    it at query time, with a marker in place of the context; the segments before
    the marker are the prefix. Each document is rendered as the chain renders it:
    with ``document_prompt``, the one given to ``create_stuff_documents_chain``
    (default ``"{page_content}"``). A query whose context starts with one of these
    documents then reads its KV from the store (under ``llm.cache_salt``: the documents
    serve that tenant's requests), and blend mode finds them anywhere in the context.
    Returns the engine's ``PrewarmReport``.
    """
    from langchain_core.prompts import format_document

    from kvboost_rag.canonical import segments_before
    from langchain_kvboost.messages import to_chat_messages

    if context_variable not in prompt.input_variables:
        msg = (
            f"the prompt has no {{{context_variable}}} variable (it has {prompt.input_variables}); "
            "pass context_variable"
        )
        raise ValueError(msg)
    variables = {v: "" for v in prompt.input_variables} | other_variables | {context_variable: _MARKER}
    engine = llm.engine
    segments = engine.canonicalizer.segments_of(to_chat_messages(prompt.format_messages(**variables)))
    prefix = segments_before(segments, _MARKER)
    if document_prompt is None:
        texts = [d.page_content for d in documents]
    else:
        texts = [format_document(d, document_prompt) for d in documents]
    return engine.prewarm(texts, prefix=prefix, pin=pin, cache_salt=llm.cache_salt)
