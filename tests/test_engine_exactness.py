"""Contract 2: logits and tokens are bitwise identical whatever share of chunks comes from cache."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Segment

ARCHS = ["llama", "qwen2", "mistral", "phi3", "gemma", "gpt2"]

SYSTEM = "You answer questions about documents. Keep answers short and exact. " * 2
DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 5,
    "A key-value cache stores attention keys and values per token. " * 4,
    "Chunks never cross a segment boundary, so a document keeps its tokens. " * 3,
]
QUESTION = "Which animal jumps over the dog? Answer with one word."


def prompt(docs=DOCS, question=QUESTION):
    return [Segment(SYSTEM, "text"), *(Segment(d, "document") for d in docs), Segment(question, "text")]


def run(engine, p, **kw):
    return engine.generate(p, max_new_tokens=12, return_logits=True, **kw)


def same(a, b):
    assert torch.equal(a.first_logits, b.first_logits), (a.first_logits - b.first_logits).abs().max()
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("schedule", ["invariant", "canonical"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cold_partial_full_hits_are_bitwise_identical(arch, dtype, schedule):
    model, tok = tiny_model(arch, dtype), tiny_tokenizer()
    cfg = EngineConfig(chunk_size=16, prefill_schedule=schedule, held_context_tokens=0)  # through the store
    uncached = run(KVBoostEngine(model, tok, config=cfg.model_copy(update={"reuse": "off"})), prompt())
    assert uncached.usage.cached_tokens == 0 and uncached.usage.stored_tokens == 0

    engine = KVBoostEngine(model, tok, config=cfg)
    cold = run(engine, prompt())
    assert cold.usage.cached_tokens == 0
    assert cold.usage.recomputed_tokens == cold.usage.prompt_tokens
    same(uncached, cold)

    full = run(engine, prompt())
    assert full.usage.cached_tokens == full.usage.prompt_tokens
    assert full.usage.cached_tokens_by_tier == {"memory": full.usage.prompt_tokens}
    assert full.usage.recomputed_tokens == 0
    same(cold, full)

    # Partial: only the shared prefix (system + first document) is in a fresh store.
    partial_engine = KVBoostEngine(model, tok, config=cfg)
    partial_engine.warm(prompt()[:2])
    partial = run(partial_engine, prompt())
    assert 0 < partial.usage.cached_tokens < partial.usage.prompt_tokens
    assert partial.usage.cached_tokens + partial.usage.recomputed_tokens == partial.usage.prompt_tokens
    same(cold, partial)


@pytest.mark.parametrize("schedule", ["invariant", "canonical"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_holes_in_the_middle_are_recomputed_exactly(arch, schedule):
    """A chunk missing in the middle is recomputed; the chunks after it are still reused, bit for bit."""
    model, tok = tiny_model(arch), tiny_tokenizer()
    config = EngineConfig(
        chunk_size=16, prefill_schedule=schedule, held_context_tokens=0
    )  # through the store
    engine = KVBoostEngine(model, tok, config=config)
    cold = run(engine, prompt())
    chunks = engine.core.chunks(engine.canonicalize(prompt()))
    engine.store.remove(chunks[2].key)
    holed = run(engine, prompt())
    assert holed.usage.recomputed_tokens == chunks[2].num_tokens
    same(cold, holed)


def test_new_question_after_shared_documents_reuses_them():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16))
    run(engine, prompt())
    other = run(engine, prompt(question="What does a key-value cache store?"))
    fresh = run(
        KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16)),
        prompt(question="What does a key-value cache store?"),
    )
    assert other.usage.cached_tokens >= sum(len(tok.encode(t)) for t in [SYSTEM, *DOCS]) - 16
    same(fresh, other)


def test_sampling_with_seed_is_identical_cold_and_warm():
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    engine = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16))
    a = engine.generate(prompt(), max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    b = engine.generate(prompt(), max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    assert b.usage.cached_tokens == b.usage.prompt_tokens
    assert a.token_ids == b.token_ids


def test_chat_messages_reuse_history_across_turns():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOCS[0] + QUESTION}]
    first = engine.generate(history, max_new_tokens=8)
    history += [
        {"role": "assistant", "content": first.text or "ok"},
        {"role": "user", "content": "And then?"},
    ]
    second = engine.generate(history, max_new_tokens=8, return_logits=True)
    assert second.usage.cached_tokens > 0
    ref = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16, reuse="off"))
    same(ref.generate(history, max_new_tokens=8, return_logits=True), second)


@pytest.mark.parametrize("schedule", ["invariant", "canonical"])
def test_last_chunk_without_logits_is_recomputed(schedule):
    """A prompt whose every chunk is stored, but not as a final chunk, recomputes its last token
    (split-invariant forward) or its last chunk (canonical schedule)."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = EngineConfig(chunk_size=16, prefill_schedule=schedule, held_context_tokens=0)  # through the store
    engine = KVBoostEngine(model, tok, config=cfg)
    longer = run(engine, prompt())
    shorter_prompt = prompt()[:-1]
    cold = run(KVBoostEngine(model, tok, config=cfg), shorter_prompt)
    warm = run(engine, shorter_prompt)
    chunks = engine.core.chunks(engine.canonicalize(shorter_prompt))
    assert warm.usage.recomputed_tokens == (1 if schedule == "invariant" else chunks[-1].num_tokens)
    assert longer.usage.prompt_tokens > warm.usage.prompt_tokens
    same(cold, warm)
