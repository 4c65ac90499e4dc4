"""Blend reuse finds every pre-warmed document whole, its last partial chunk included, wherever a
framework's prompt template pastes it."""

from __future__ import annotations

import random

import pytest
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine

WORDS = "amber basil cedar dune ember fjord grove heath inlet jade knoll loam marsh".split()
DOCS = [
    f"Passage {i} says " + " ".join(random.Random(10 + i).choices(WORDS, k=40 + 9 * i)) + "."
    for i in range(3)
]
QUESTION = "Which passage names the fjord?"
SLACK_PER_DOC = 2
"""Tokens at a document's edges that may tokenize differently in a template (a label's space before it)."""

# The template shapes frameworks use: documents after paragraph breaks, after single newlines,
# between LlamaIndex's separator lines (its default QA prompt), and after the question on a label's line.
SHAPES = {
    "paragraph break": "Context:\n\n{0}\n\n{1}\n\n{2}\n\nQuestion: {q}",
    "single newline": "Context:\n{0}\n{1}\n{2}\nQuestion: {q}",
    "separator line": (
        "Context information is below.\n---------------------\n{0}\n\n{1}\n\n{2}\n---------------------\n"
        "Given the context information and not prior knowledge, answer the query.\nQuery: {q}\nAnswer: "
    ),
    "question first": "Question: {q}\nContext: {0}\n\n{1}\n\n{2}\nAnswer:",
}


@pytest.fixture(scope="module")
def engine():
    engine = KVBoostEngine(
        tiny_model("llama"),
        tiny_tokenizer(),
        config=EngineConfig(reuse="blend", blend_recompute_ratio=0.0, blend_boundary_tokens=0),
    )
    engine.prewarm(DOCS, prefix="Context:\n")
    return engine


def test_the_documents_end_in_partial_chunks(engine):
    tails = [len(engine.canonicalizer.tokenize(d)) % engine.core.chunk_size for d in DOCS]
    assert all(tail > 4 * SLACK_PER_DOC for tail in tails), tails  # a recomputed tail would show


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_document_token_is_reused_whatever_the_template(engine, shape):
    text = SHAPES[shape].format(*DOCS, q=QUESTION)
    r = engine.generate(text, max_new_tokens=2)
    document_tokens = sum(len(engine.canonicalizer.tokenize(d)) for d in DOCS)
    other_tokens = r.usage.prompt_tokens - document_tokens
    # With no boundary and no selected recompute, only what is not a document is computed.
    assert r.usage.recomputed_tokens <= other_tokens + SLACK_PER_DOC * len(DOCS), r.usage
    assert r.usage.approx_tokens > 0


def test_a_prompt_without_the_documents_blends_nothing(engine):
    r = engine.generate(SHAPES["single newline"].format("a", "b", "c", q=QUESTION), max_new_tokens=2)
    assert r.usage.approx_tokens == 0 and r.usage.recomputed_tokens == r.usage.prompt_tokens


def test_exact_mode_says_which_pre_warmed_tokens_it_left_unused(caplog):
    engine = KVBoostEngine(tiny_model("llama"), tiny_tokenizer())
    engine.prewarm(DOCS, prefix="Context:\n")
    document_tokens = sum(len(engine.canonicalizer.tokenize(d)) for d in DOCS)
    with caplog.at_level("WARNING", logger="kvboost_rag.unused_documents"):
        r = engine.generate(SHAPES["question first"].format(*DOCS, q=QUESTION), max_new_tokens=2)
        again = engine.generate(SHAPES["question first"].format(*DOCS[::-1], q=QUESTION), max_new_tokens=2)
    assert document_tokens * 0.6 <= r.usage.unused_prewarmed_tokens <= document_tokens  # an estimate
    assert again.usage.unused_prewarmed_tokens > 0
    [warning] = [rec.getMessage() for rec in caplog.records if "pre-warmed documents" in rec.getMessage()]
    assert "reuse='blend'" in warning  # the why and the fix, once
    assert r.reuse_report()["unused_prewarmed_tokens"] == r.usage.unused_prewarmed_tokens
    read = engine.generate("Context:\n" + DOCS[1], max_new_tokens=2)  # the document as pre-warmed
    assert read.usage.unused_prewarmed_tokens == 0


def test_blend_reports_what_it_laid_and_what_was_gone(engine, caplog):
    text = SHAPES["separator line"].format(*DOCS, q=QUESTION)
    r = engine.generate(text, max_new_tokens=2)
    assert r.usage.blended_tokens >= r.usage.approx_tokens > 0 and r.usage.unused_prewarmed_tokens == 0
    fresh = KVBoostEngine(engine.model, engine.tokenizer, config=engine.config)
    fresh.registry.add_sources(dict(engine.registry._sources))  # records of documents whose KV is gone
    with caplog.at_level("WARNING", logger="kvboost_rag.unused_documents"):
        gone = fresh.generate(text, max_new_tokens=2)
    assert gone.usage.blended_tokens == 0 and gone.usage.unused_prewarmed_tokens > 0
    assert any("evicted or removed" in rec.getMessage() for rec in caplog.records)


def test_another_tenant_learns_nothing_from_the_unused_count():
    engine = KVBoostEngine(tiny_model("llama"), tiny_tokenizer())
    engine.prewarm(DOCS, prefix="Context:\n", cache_salt="tenant-a")
    text = SHAPES["question first"].format(*DOCS, q=QUESTION)
    assert engine.generate(text, max_new_tokens=1, cache_salt="tenant-a").usage.unused_prewarmed_tokens > 0
    assert engine.generate(text, max_new_tokens=1, cache_salt="tenant-b").usage.unused_prewarmed_tokens == 0
    assert engine.generate(text, max_new_tokens=1).usage.unused_prewarmed_tokens == 0
