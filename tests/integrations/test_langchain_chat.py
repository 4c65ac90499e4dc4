"""ChatKVBoost in LangChain chains: RAG reuse, pre-warming, async, streaming callbacks, stop, errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from helpers import essay_paragraphs, record_admissions, record_astreams, run_while_ticking  # noqa: E402
from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.runnables import RunnableLambda, RunnablePassthrough  # noqa: E402

from kvboost_rag import InvalidRequestError  # noqa: E402
from langchain_kvboost import ChatKVBoost, prewarm_documents  # noqa: E402
from langchain_kvboost.documents import format_documents  # noqa: E402

pytestmark = pytest.mark.real_model

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)


class KeywordRetriever(BaseRetriever):
    """Top-k documents by shared lowercase words: deterministic and offline."""

    documents: list[Document]
    k: int = 2

    def _get_relevant_documents(self, query: str, *, run_manager=None) -> list[Document]:
        words = set(query.lower().split())
        scored = sorted(self.documents, key=lambda d: -len(words & set(d.page_content.lower().split())))
        return scored[: self.k]


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return [
        Document(page_content=p, metadata={"i": i}) for i, p in enumerate(essay_paragraphs(6, max_chars=900))
    ]


def llm(**kw) -> ChatKVBoost:
    return ChatKVBoost(**({"model": "smollm2-135m-instruct", "dtype": "float32", "max_tokens": 16} | kw))


def rag_chain(model: ChatKVBoost, retriever: BaseRetriever, prompt: ChatPromptTemplate = PROMPT):
    return (
        {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()}
        | prompt
        | model
    )


def test_rag_chain_reuses_shared_documents_and_matches_the_uncached_answer(documents):
    # one fixed pair of documents for both questions, as a retriever would return for related questions
    retriever = KeywordRetriever(documents=documents[:2], k=2)
    chain = rag_chain(llm(), retriever)
    first = chain.invoke("What does the author think about startups?")
    second = chain.invoke("What is the main advice in these texts?")
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0
    # the documents come from the first question's held context (or the memory tier), counted by tier
    tiers = second.response_metadata["kvboost"]["cached_tokens_by_tier"]
    assert sum(tiers.values()) == second.usage_metadata["input_token_details"]["cache_read"]
    assert set(tiers) <= {"context", "memory"}
    uncached = rag_chain(llm(reuse="off"), retriever).invoke("What is the main advice in these texts?")
    assert uncached.usage_metadata["input_token_details"]["cache_read"] == 0
    assert second.content == uncached.content
    assert first.response_metadata["finish_reason"] in ("stop", "length")


def test_prewarmed_first_document_is_read_from_the_store(documents, tmp_path):
    model = llm(store_dir=str(tmp_path / "kv"))
    report = prewarm_documents(model, documents[2:5], PROMPT, context_variable="context")
    assert report.documents == 3 and report.skipped == 0
    retriever = KeywordRetriever(documents=[documents[3], documents[0]], k=2)
    answer = rag_chain(model, retriever).invoke("Which point is made first?")
    doc_tokens = len(model.engine.canonicalizer.tokenize(documents[3].page_content))
    assert answer.usage_metadata["input_token_details"]["cache_read"] >= doc_tokens
    again = prewarm_documents(model, documents[2:5], PROMPT)
    assert again.skipped == 3


# Blend finds a pre-warmed document where it starts a paragraph, so the context follows a blank line.
PARAGRAPH_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Be brief."),
        ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
    ]
)


def test_blend_reuses_prewarmed_documents_in_any_order_and_labels_them(documents, tmp_path):
    model = llm(store_dir=str(tmp_path / "kv"), reuse="blend")
    prewarm_documents(model, documents[2:5], PARAGRAPH_PROMPT, context_variable="context")
    retriever = KeywordRetriever(documents=[documents[4], documents[2], documents[3]], k=3)
    answer = rag_chain(model, retriever, PARAGRAPH_PROMPT).invoke("Which point is made first?")
    report = answer.response_metadata["kvboost"]
    assert report["approx_tokens"] > 0  # documents found away from the position they were pre-warmed at
    assert answer.usage_metadata["input_token_details"]["cache_read"] == report["cached_tokens"]
    assert (
        report["cached_tokens"] + report["approx_tokens"] + report["recomputed_tokens"]
        == answer.usage_metadata["input_tokens"]
    )
    exact = rag_chain(llm(store_dir=str(tmp_path / "kv")), retriever, PARAGRAPH_PROMPT).invoke(
        "Which point is made first?"
    )
    assert exact.response_metadata["kvboost"]["approx_tokens"] == 0


def test_prewarm_needs_the_context_variable(documents):
    with pytest.raises(ValueError, match="no \\{ctx\\} variable"):
        prewarm_documents(llm(), documents[:1], PROMPT, context_variable="ctx")


def test_ainvoke_keeps_the_event_loop_responsive():
    model = llm(max_tokens=24)
    messages = [HumanMessage("Write a short poem about the sea.")]
    model.invoke(messages)  # load the engine first

    _, ticks, elapsed = run_while_ticking(lambda: model.ainvoke(messages, reuse="off"))
    assert elapsed > 0.05
    assert ticks >= 0.3 * elapsed / 0.005, (ticks, elapsed)


def test_astream_is_native_gives_the_invoke_text_and_stops_when_the_consumer_leaves(monkeypatch):
    from langchain_core.language_models.chat_models import BaseChatModel

    assert ChatKVBoost._astream is not BaseChatModel._astream  # not LangChain's thread wrapper
    model = llm(max_tokens=24)
    messages = [HumanMessage("Write a short poem about the sea.")]
    whole = model.invoke(messages)
    opened = record_astreams(monkeypatch, model.engine)

    async def read_all():
        return [chunk async for chunk in model.astream(messages)]

    chunks, ticks, elapsed = run_while_ticking(read_all)
    assert "".join(c.content for c in chunks) == whole.content
    assert chunks[-1].usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"]
    assert ticks >= 0.3 * elapsed / 0.005, (ticks, elapsed)

    async def read_two():
        got = []
        async for chunk in model.astream(messages):
            got.append(chunk)
            if len(got) == 2:
                break  # the consumer leaves: the request stops at its next token
        return got

    asyncio.run(read_two())
    assert opened[-1].feed.stopped  # the engine's stream was stopped, not left running


def test_stream_fires_one_callback_per_delta_and_marks_the_last_chunk():
    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    handler = Tokens()
    chunks = list(llm().stream([HumanMessage("Count from one to five.")], config={"callbacks": [handler]}))
    text = "".join(c.content for c in chunks)
    assert "".join(handler.tokens) == text and len(handler.tokens) >= 2
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].response_metadata["finish_reason"] in ("stop", "length")


def test_stop_sequences_trim_the_answer():
    messages = [HumanMessage("Count from one to ten.")]
    free = llm(max_tokens=24).invoke(messages)
    stop = next(s for s in ("\n", ",", ".", " ") if s in free.content[1:])
    stopped = llm(max_tokens=24).invoke(messages, stop=[stop])
    assert stopped.content == free.content[: free.content.index(stop, 1)]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_bad_messages_get_clear_errors():
    with pytest.raises(InvalidRequestError, match="empty"):
        llm().invoke([])
    image = HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])
    with pytest.raises(InvalidRequestError, match="text blocks only"):
        llm().invoke([SystemMessage("hi"), image])


def test_batch_and_abatch_are_served_in_shared_batches(monkeypatch):
    sizes = record_admissions(monkeypatch)
    model = llm(max_tokens=8)
    questions = [[HumanMessage(f"Name a {thing}.")] for thing in ("color", "fruit", "city", "planet")]
    alone = [model.invoke(q).content for q in questions]
    assert sizes == []
    assert [m.content for m in model.batch(questions)] == alone
    assert max(sizes) > 1
    sizes.clear()
    assert [m.content for m in asyncio.run(model.abatch(questions))] == alone
    assert max(sizes) > 1


def test_the_redis_password_never_leaves_in_a_dump():
    chat = ChatKVBoost(redis_url="redis://:s3cret@127.0.0.1:1/0")
    for shown in (repr(chat), str(chat.model_dump()), chat.model_dump_json()):
        assert "s3cret" not in shown
    assert chat.redis_url == "redis://:s3cret@127.0.0.1:1/0"


def test_cache_salt_keeps_tenants_apart():
    messages = [("system", "Tenant notes (LangChain): the vault code is 0417."), ("human", "Hi")]

    def cached(model: ChatKVBoost, **kw: Any) -> int:
        return model.invoke(messages, **kw).response_metadata["kvboost"]["cached_tokens"]

    tenant_a, tenant_b = (
        llm(max_tokens=1, cache_salt="langchain-tenant-a"),
        llm(max_tokens=1, cache_salt="langchain-tenant-b"),
    )
    assert cached(tenant_a) == 0
    assert cached(tenant_b) == 0
    everything = cached(tenant_a)
    assert everything > 0
    # without a salt, only the chat template's opening is shared (with earlier unsalted prompts)
    assert cached(llm(max_tokens=1)) < everything
    assert cached(tenant_b, cache_salt="langchain-tenant-a") == everything  # per call too
