"""Exact reuse to the token: a prompt that shares part of a stored chunk (after the same prefix)
lays those tokens and computes only the rest, bitwise as a fresh engine computes it all."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.canonical import PromptInput

CHUNK = 16


def engine_for(model, tok, **config) -> KVBoostEngine:
    """An engine without held contexts: warm requests read through the store (see test_held_context.py)."""
    return KVBoostEngine(model, tok, config=EngineConfig(chunk_size=CHUNK, held_context_tokens=0, **config))


def answer(engine: KVBoostEngine, prompt: PromptInput, **settings):
    return engine.generate(prompt, max_new_tokens=6, return_logits=True, **settings)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def text_of(tok, n_tokens: int) -> str:
    text = " ".join(essay_paragraphs(40, max_chars=3000))
    return tok.decode(tok.encode(text, add_special_tokens=False)[:n_tokens])[:-2]


def prompts(tok, shape: str) -> tuple[PromptInput, PromptInput]:
    """A stored prompt and one that extends it inside its last chunk (of the message, for chat)."""
    doc = text_of(tok, 300)
    if shape == "flat":
        return doc + " What is said first?", doc + " What is said first? Again, in other words."
    question = [{"role": "system", "content": "Answer from the document."}]
    return (
        [*question, {"role": "user", "content": doc + "\nWhich animal jumps?"}],
        [*question, {"role": "user", "content": doc + "\nWhich animal jumps? Say it twice."}],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["flat", "chat"])
def test_an_extended_prompt_recomputes_only_the_tokens_past_the_longest_common_prefix(shape, dtype):
    model, tok = tiny_model("llama", dtype), tiny_tokenizer()
    stored, extended = prompts(tok, shape)
    engine = engine_for(model, tok)
    answer(engine, stored)
    warm = answer(engine, extended)
    cold = answer(engine_for(model, tok), extended)
    canonical = engine.canonicalize(extended)
    common = common_prefix(engine.canonicalize(stored).token_ids, canonical.token_ids)
    # the prompts part inside a chunk: whole-chunk reuse would recompute more
    assert any(c.start < common < c.end for c in engine.core.chunks(canonical))
    ids = canonical.token_ids
    new_tokens = len(ids) - common
    assert warm.usage.recomputed_tokens == new_tokens
    assert warm.usage.cached_tokens == len(ids) - new_tokens
    assert torch.equal(warm.first_logits, cold.first_logits)
    assert warm.token_ids == cold.token_ids


def test_a_prompt_ending_inside_a_stored_chunk_computes_only_its_last_token():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    shorter, longer = prompts(tok, "flat")
    engine = engine_for(model, tok)
    answer(engine, longer)
    warm = answer(engine, shorter)
    ids = engine.canonicalize(shorter).token_ids
    assert common_prefix(engine.canonicalize(longer).token_ids, ids) == len(ids)
    assert warm.usage.recomputed_tokens == 1
    cold = answer(engine_for(model, tok), shorter)
    assert torch.equal(warm.first_logits, cold.first_logits) and warm.token_ids == cold.token_ids


def test_tokens_are_shared_only_under_the_same_prefix_and_tenant():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    stored, extended = prompts(tok, "flat")
    engine = engine_for(model, tok)
    answer(engine, stored, cache_salt="tenant-a")
    other_tenant = answer(engine, extended, cache_salt="tenant-b")
    assert other_tenant.usage.cached_tokens == 0
    other_prefix = answer(engine, "Preface. " + extended)
    assert other_prefix.usage.cached_tokens == 0


def test_a_chunk_evicted_since_it_was_indexed_is_recomputed_and_forgotten():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    stored, extended = prompts(tok, "flat")
    engine = engine_for(model, tok)
    answer(engine, stored)
    engine.store.clear()
    warm = answer(engine, extended)
    assert warm.usage.cached_tokens == 0
    assert torch.equal(warm.first_logits, answer(engine_for(model, tok), extended).first_logits)
    again = answer(engine, extended)  # the stale chunk forgotten, the new ones indexed and stored
    assert again.usage.recomputed_tokens == 0


def test_chunks_read_from_disk_are_indexed_for_the_next_prompt(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    stored, extended = prompts(tok, "flat")
    config = EngineConfig(chunk_size=CHUNK)
    with KVBoostEngine(model, tok, config=config, store_dir=tmp_path) as writer:
        answer(writer, stored)
    with KVBoostEngine(model, tok, config=config, store_dir=tmp_path) as reader:
        assert answer(reader, stored).usage.cached_tokens_by_tier.get("disk", 0) > 0
        warm = answer(reader, extended)
        ids = reader.canonicalize(extended).token_ids
        assert warm.usage.recomputed_tokens == len(ids) - common_prefix(
            reader.canonicalize(stored).token_ids, ids
        )
