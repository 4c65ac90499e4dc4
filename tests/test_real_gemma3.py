"""Exact reuse on Gemma 3 270M (five 512-token sliding-window layers per global one) past its window."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_answers_as_the_models_own_cache, essay_paragraphs

from kvboost_rag import EngineConfig, KVBoostEngine

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma3_bf16(gemma3):
    model, tok = gemma3
    return copy.deepcopy(model).to(torch.bfloat16), tok


def essay_tokens(tok, n: int, skip: int = 0) -> str:
    text = " ".join(essay_paragraphs(80, max_chars=3000))
    return tok.decode(tok.encode(text, add_special_tokens=False)[skip : skip + n])


@pytest.mark.parametrize("prefix_tokens", [300, 1500, 4000])
def test_flat_prompts_read_a_shared_prefix_past_the_window_bitwise(gemma3_bf16, prefix_tokens):
    """A flat prompt sharing P tokens with a stored one reads >= P - 64 of them, and its first logits
    are bitwise those of a fresh engine with an empty store."""
    model, tok = gemma3_bf16
    shared = essay_tokens(tok, prefix_tokens)[:-2]  # cut mid-word
    engine = KVBoostEngine(model, tok)
    assert engine.stats()["reuse"]["schedule"] == "invariant"
    engine.generate(shared + " What is the main point?", max_new_tokens=1)
    prompt = shared + " Which example stands out?"
    warm = engine.generate(prompt, max_new_tokens=4, return_logits=True)
    cold = KVBoostEngine(model, tok).generate(prompt, max_new_tokens=4, return_logits=True)
    assert warm.reuse_note is None
    assert warm.usage.cached_tokens >= len(engine.canonicalize(shared)) - 64
    assert torch.equal(warm.first_logits, cold.first_logits) and warm.token_ids == cold.token_ids


def test_answers_past_the_window_equal_transformers_own_forward(gemma3):
    model, tok = gemma3
    prompt = essay_tokens(tok, 1200, skip=100) + "\n\nIn one sentence, the essay says that"
    engine = KVBoostEngine(model, tok, config=EngineConfig(max_draft_tokens=0))
    engine.generate(prompt, max_new_tokens=1)
    result = engine.generate(prompt, max_new_tokens=10, return_logits=True)
    assert result.usage.cached_tokens == result.usage.prompt_tokens
    assert_answers_as_the_models_own_cache(engine, model, prompt, result, tolerance=1e-3)


def test_a_chat_turn_sent_at_once_past_the_window_computes_little_and_answers_as_a_fresh_engine(gemma3_bf16):
    model, tok = gemma3_bf16
    engine = KVBoostEngine(model, tok)
    messages = [
        {"role": "system", "content": "Answer from the essay."},
        {"role": "user", "content": essay_tokens(tok, 900) + "\n\nWhat is the essay about?"},
    ]
    first = engine.generate(messages, max_new_tokens=24)
    following = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    second = engine.generate(following, max_new_tokens=8, return_logits=True)
    fresh = KVBoostEngine(model, tok).generate(following, max_new_tokens=8, return_logits=True)
    new_message = len(engine.canonicalize(following)) - len(
        engine.canonicalize(
            [*messages, {"role": "assistant", "content": first.text}], add_generation_prompt=False
        )
    )
    assert second.usage.recomputed_tokens <= new_message + 32, (second.usage, new_message)
    assert torch.equal(second.first_logits, fresh.first_logits) and second.token_ids == fresh.token_ids
