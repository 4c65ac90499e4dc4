"""Store codecs end to end: a lossless codec keeps exact mode bitwise; a lossy one is reused only
where it was chosen, and its hits count as approximate, never as exact."""

from __future__ import annotations

import pytest
import torch
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, GenerationResult, KVBoostEngine

PROMPT = "Answer from the document below.\n\n" + essay_paragraphs(1, max_chars=900)[0] + "\n\nQuestion: why?"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def run(model, store_dir, codec: str, reuse: str = "exact") -> GenerationResult:
    """One request on an engine of its own (an empty memory tier) over ``store_dir``."""
    config = EngineConfig(store_codec=codec, reuse=reuse)
    with KVBoostEngine(model, tiny_tokenizer(), config=config, store_dir=store_dir) as engine:
        result = engine.generate(PROMPT, max_new_tokens=6, return_logits=True)
        engine.flush()
    return result


def test_the_lossless_codec_serves_exact_mode_bitwise_from_disk(model, tmp_path):
    cold = run(model, None, "raw", reuse="off")
    run(model, tmp_path, "zstd")  # stores the prompt's chunks, compressed
    warm = run(model, tmp_path, "zstd")
    assert warm.usage.cached_tokens_by_tier.get("disk", 0) > 0 and warm.usage.approx_tokens == 0
    assert warm.token_ids == cold.token_ids
    assert torch.equal(warm.first_logits, cold.first_logits)


def test_quantized_hits_count_as_approximate_and_an_exact_store_never_serves_them(model, tmp_path):
    cold = run(model, None, "raw", reuse="off")
    run(model, tmp_path, "int8")
    lossy = run(model, tmp_path, "int8")
    assert lossy.usage.approx_tokens > 0
    assert lossy.usage.cached_tokens == 0  # nothing it reused was exact
    assert lossy.usage.approx_tokens + lossy.usage.recomputed_tokens == lossy.usage.prompt_tokens
    assert lossy.usage.completion_tokens == 6

    exact = run(model, tmp_path, "raw")  # the same store, configured exact
    assert exact.usage.approx_tokens == 0 and exact.usage.cached_tokens == 0  # lossy entries are misses
    assert exact.token_ids == cold.token_ids and torch.equal(exact.first_logits, cold.first_logits)
