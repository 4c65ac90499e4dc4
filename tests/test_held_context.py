"""Held contexts: a request that continues the last exact request goes on from its cache (nothing it
shares laid again, only what follows computed), bitwise as a fresh engine computes it all."""

from __future__ import annotations

import pytest
import torch
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.assembler.buffered_cache import BufferedCache
from kvboost_rag.canonical import PromptInput
from kvboost_rag.held_context import TIER, HeldContexts, common_prefix

CHUNK = 16


def engine_for(model, tok, **config) -> KVBoostEngine:
    return KVBoostEngine(model, tok, config=EngineConfig(chunk_size=CHUNK, **config))


def answer(engine: KVBoostEngine, prompt: PromptInput, **settings):
    return engine.generate(prompt, max_new_tokens=6, return_logits=True, **settings)


def document(tok, n_tokens: int = 300) -> str:
    text = " ".join(essay_paragraphs(40, max_chars=3000))
    return tok.decode(tok.encode(text, add_special_tokens=False)[:n_tokens])[:-2]


def assert_as_fresh(model, tok, result, prompt: PromptInput, **settings) -> None:
    cold = answer(engine_for(model, tok), prompt, **settings)
    assert torch.equal(result.first_logits, cold.first_logits)
    assert result.token_ids == cold.token_ids


def test_the_next_chat_turn_goes_on_from_the_last_turns_cache_reply_included():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok)
    turn = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": document(tok)},
    ]
    first = answer(engine, turn)
    following = [
        *turn,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then?"},
    ]
    second = answer(engine, following)
    held = engine.stats()["context"]
    assert held["reads"] == 1
    # everything the first turn computed or fed is read from its cache: the prompt and the reply
    assert second.usage.cached_tokens_by_tier[TIER] > first.usage.prompt_tokens
    assert second.usage.cached_tokens_by_tier.get("memory", 0) < CHUNK  # at most a chunk laid whole
    assert_as_fresh(model, tok, second, following)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "then",
    [" What is said first? Again, in other words.", " When was it written, and where?"],
    ids=["extended", "new-question"],
)
def test_a_prompt_that_shares_the_last_one_computes_only_what_follows_the_shared_tokens(then, dtype):
    model, tok = tiny_model("llama", dtype), tiny_tokenizer()
    engine = engine_for(model, tok)
    stored, following = document(tok) + " What is said first?", document(tok) + then
    answer(engine, stored)
    warm = answer(engine, following)
    ids = engine.canonicalize(following).token_ids
    shared = common_prefix(engine.canonicalize(stored).token_ids, ids)
    assert warm.usage.recomputed_tokens == len(ids) - shared
    assert warm.usage.cached_tokens_by_tier == {TIER: shared}
    assert_as_fresh(model, tok, warm, following)


def test_the_same_prompt_again_lays_its_stored_last_chunk_with_its_logits():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok)
    prompt = document(tok) + " What is said first?"
    answer(engine, prompt)
    again = answer(engine, prompt)
    assert again.usage.recomputed_tokens == 0
    assert again.usage.cached_tokens == again.usage.prompt_tokens
    assert again.usage.cached_tokens_by_tier[TIER] > 0
    assert_as_fresh(model, tok, again, prompt)
    # the cache it leaves holds the prompt as a prefill does: a request that continues it agrees too
    following = prompt + again.text + " And then?"
    assert_as_fresh(model, tok, answer(engine, following), following)


def test_another_tenant_never_reads_the_context():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok)
    prompt = document(tok) + " What is said first?"
    answer(engine, prompt, cache_salt="tenant-a")
    other = answer(engine, prompt + " Again.", cache_salt="tenant-b")
    assert TIER not in other.usage.cached_tokens_by_tier
    assert other.usage.cached_tokens == 0
    same = answer(engine, prompt + " Again.", cache_salt="tenant-a")
    assert same.usage.cached_tokens_by_tier[TIER] > 0


def test_reuse_off_and_blend_neither_keep_nor_take_a_context():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok)
    prompt = document(tok) + " What is said first?"
    answer(engine, prompt, reuse="off")
    assert engine.stats()["context"]["contexts"] == 0
    answer(engine, prompt)
    assert engine.stats()["context"]["contexts"] == 1
    for mode in ("off", "blend"):
        result = answer(engine, prompt + " Again.", reuse=mode)
        assert TIER not in result.usage.cached_tokens_by_tier
    assert engine.stats()["context"]["reads"] == 0


def test_a_shared_system_prompt_alone_leaves_the_context_to_its_conversation():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok)
    system = {"role": "system", "content": "Answer from the document."}
    conversation = [system, {"role": "user", "content": document(tok)}]
    first = answer(engine, conversation)
    stranger = answer(engine, [system, {"role": "user", "content": "Hello there."}])
    assert TIER not in stranger.usage.cached_tokens_by_tier
    following = [
        *conversation,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "More?"},
    ]
    assert answer(engine, following).usage.cached_tokens_by_tier[TIER] > first.usage.prompt_tokens


def test_no_context_is_held_with_a_budget_of_zero():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok, held_context_tokens=0)
    prompt = document(tok) + " What is said first?"
    answer(engine, prompt)
    warm = answer(engine, prompt + " Again.")
    assert TIER not in warm.usage.cached_tokens_by_tier
    assert warm.usage.cached_tokens > 0  # from the store, as before
    assert engine.stats()["context"] == {"contexts": 0, "held_tokens": 0, "reads": 0, "read_tokens": 0}


def cache_of(tokens: int, window: int | None = None) -> BufferedCache:
    cache = BufferedCache(1, tokens, windows=[window])
    kv = torch.randn(1, 2, tokens, 4)
    cache.layers[0].update(kv, kv)
    return cache


def test_the_oldest_contexts_go_beyond_the_token_budget():
    held = HeldContexts(max_tokens=100)
    held.keep("ns", list(range(60)), cache_of(60))
    held.keep("ns", list(range(100, 150)), cache_of(50))
    assert held.stats()["contexts"] == 1  # 110 tokens: the first went
    assert held.take("ns", list(range(60)) + [7]) is None
    taken = held.take("ns", list(range(100, 160)))
    assert taken is not None and taken[1] == 50
    assert held.stats()["contexts"] == 0  # taken: the request writes into it


def test_take_leaves_the_last_token_to_compute_and_cuts_the_cache_back():
    held = HeldContexts(max_tokens=100)
    held.keep("ns", list(range(40)), cache_of(40))
    assert held.take("other", list(range(40))) is None  # another namespace (or tenant)
    taken = held.take("ns", list(range(30)))
    assert taken is not None
    cache, shared = taken
    assert shared == 29 and cache.get_seq_length() == 29


def test_a_cache_whose_window_layers_dropped_positions_is_not_held():
    held = HeldContexts(max_tokens=4096)
    cache = cache_of(1600, window=256)
    cache.drop_behind(1600)
    assert cache.held_from > 0
    held.keep("ns", list(range(1600)), cache)
    assert held.stats()["contexts"] == 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [1]) == 0
