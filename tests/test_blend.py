"""Blend reuse: opt-in only, honest counts, exact machinery at full recompute,
refused where it cannot be exact."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import (
    EngineConfig,
    InvalidRequestError,
    KVBoostEngine,
    Request,
    Segment,
    UnsupportedModelError,
)
from kvboost_rag.blend import BlendSettings, blend_prefill

WORDS = "alpha bravo charlie delta echo golf hotel india kilo lima oscar papa romeo tango victor zulu".split()
DOCS = [f"Document {i}: " + " ".join(random.Random(i).choices(WORDS, k=30)) + "." for i in range(4)]
"""Passages with little in common (blend finds a document by its tokens)."""
PREFIX = "Context: "


def prompt(order: list[int]) -> list[Segment]:
    docs = [Segment(DOCS[i], "document") for i in order]
    return [Segment(PREFIX), *docs, Segment("Question: which fox?")]


def warmed(arch: str = "llama", **config: object) -> KVBoostEngine:
    engine = KVBoostEngine(tiny_model(arch), tiny_tokenizer(), config=EngineConfig(**config))
    engine.prewarm(DOCS, prefix=[Segment(PREFIX)])
    return engine


def test_exact_mode_never_blends():
    engine = warmed()
    shuffled = prompt([2, 0, 3])
    plain = engine.generate(shuffled, max_new_tokens=8, reuse="off")
    exact = engine.generate(shuffled, max_new_tokens=8, return_logits=True)
    assert exact.usage.approx_tokens == 0
    assert exact.usage.cached_tokens > 0  # the first document follows the pre-warmed prefix
    assert exact.token_ids == plain.token_ids
    assert exact.reuse_report()["approx_tokens"] == 0


def test_blend_counts_add_up_and_are_labelled():
    engine = warmed(blend_recompute_ratio=0.2, blend_boundary_tokens=4)
    r = engine.generate(prompt([2, 0, 3]), max_new_tokens=4, reuse="blend")
    u = r.usage
    assert u.cached_tokens == len(
        engine.canonicalize([Segment(PREFIX), Segment(DOCS[2], "document")], add_generation_prompt=False)
    )
    assert u.cached_tokens + u.approx_tokens + u.recomputed_tokens == u.prompt_tokens
    reused = sum(len(engine.canonicalizer.tokenize(DOCS[i])) for i in (0, 3))  # moved to new positions
    recomputed_in_docs = 2 * 4 + math.ceil(0.2 * reused)  # boundary tokens + the selected ones
    assert u.approx_tokens == reused - recomputed_in_docs
    assert u.stored_tokens == 0  # approximate KV is never stored
    assert r.reuse_report()["approx_tokens"] == u.approx_tokens
    assert r.timings.select_s > 0


def test_nothing_after_the_exact_prefix_is_stored_and_exact_mode_stays_exact():
    engine = warmed()
    shuffled = prompt([1, 3, 0])
    entries = engine.stats()["memory"]["entries"]
    engine.generate(shuffled, max_new_tokens=4, reuse="blend")
    assert engine.stats()["memory"]["entries"] == entries
    exact = engine.generate(shuffled, max_new_tokens=8, return_logits=True)
    plain = engine.generate(shuffled, max_new_tokens=8, return_logits=True, reuse="off")
    assert torch.equal(exact.first_logits, plain.first_logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_full_recompute_reproduces_exact_mode(arch):
    """Ratio 1 recomputes every reused token over the laid cache: the masks and the re-slotting must
    reproduce full attention (float rounding aside, as the computation is shaped differently)."""
    engine = warmed(arch, blend_recompute_ratio=1.0)
    shuffled = prompt([3, 1, 2])
    blend = engine.generate(shuffled, max_new_tokens=12, return_logits=True, reuse="blend")
    plain = engine.generate(shuffled, max_new_tokens=12, return_logits=True, reuse="off")
    assert blend.usage.approx_tokens == 0 and blend.usage.recomputed_tokens > 0
    torch.testing.assert_close(blend.first_logits, plain.first_logits, atol=1e-4, rtol=0)
    assert blend.token_ids == plain.token_ids


def test_reused_documents_sit_at_their_new_positions():
    """Layer 0 KV depends on each token and its position only, so it must match a full prefill there."""
    engine = warmed(blend_recompute_ratio=0.0, blend_boundary_tokens=0)
    canonical = engine.canonicalize(prompt([3, 1, 2]))
    chunks = engine.core.chunks(canonical)
    settings = BlendSettings(0.0, 0, 1)
    out = blend_prefill(
        engine.assembler,
        engine.core.blend_shifter(),
        canonical,
        chunks,
        store=engine.store,
        registry=engine.registry,
        namespace=engine.namespace,
        settings=settings,
        capacity=len(canonical) + 4,
    )
    assert out.approx_tokens == sum(len(engine.canonicalizer.tokenize(DOCS[i])) for i in (1, 2))
    full = engine.assembler.new_cache(len(canonical))
    engine.assembler.forward(full, canonical.token_ids, 0, logits=False)
    n = len(canonical)
    assert out.cache.get_seq_length() == n
    blended = engine.assembler.extract(out.cache, 0, n)[0]
    exact = engine.assembler.extract(full, 0, n)[0]
    torch.testing.assert_close(blended, exact, atol=1e-4, rtol=0)
    assert not torch.allclose(
        engine.assembler.extract(out.cache, 0, n)[1], engine.assembler.extract(full, 0, n)[1], atol=1e-4
    )


def test_blend_finds_documents_pre_warmed_by_another_process(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    with KVBoostEngine(model, tok, store_dir=tmp_path) as writer:
        writer.prewarm(DOCS, prefix=[Segment(PREFIX)])
    with KVBoostEngine(model, tok, store_dir=tmp_path, config=EngineConfig(reuse="blend")) as reader:
        r = reader.generate(prompt([0, 2]), max_new_tokens=4)
    assert r.usage.cached_tokens_by_tier.get("disk", 0) > 0
    assert r.usage.approx_tokens > 0


def test_blend_requests_in_a_batch_run_alone_and_report():
    engine = warmed()
    results = engine.generate_batch(
        [Request(prompt([1, 2]), max_new_tokens=3, reuse="blend"), Request(prompt([0, 1]), max_new_tokens=3)]
    )
    assert results[0].usage.approx_tokens > 0
    assert results[1].usage.approx_tokens == 0


def test_unsupported_models_are_refused_at_configuration_time():
    with pytest.raises(UnsupportedModelError, match="'gpt2' models are not supported"):
        KVBoostEngine(tiny_model("gpt2"), tiny_tokenizer(), config=EngineConfig(reuse="blend"))
    exact = KVBoostEngine(tiny_model("gpt2"), tiny_tokenizer())
    with pytest.raises(UnsupportedModelError, match="use reuse='exact'"):
        exact.generate("Hello there", reuse="blend")
    dynamic = tiny_model(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(UnsupportedModelError, match="changes its frequencies"):
        KVBoostEngine(dynamic, tiny_tokenizer(), config=EngineConfig(reuse="blend"))
    with pytest.raises(ValueError, match="blend_select_layer=5, but the model has 2 layers"):
        KVBoostEngine(
            tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(reuse="blend", blend_select_layer=5)
        )


def test_recompute_ratio_per_request_and_bad_values():
    engine = warmed(blend_recompute_ratio=0.0, blend_boundary_tokens=0)
    shuffled = prompt([1, 3])
    default = engine.generate(shuffled, max_new_tokens=2, reuse="blend")
    full = engine.generate(shuffled, max_new_tokens=2, reuse="blend", blend_recompute_ratio=1.0)
    assert default.usage.approx_tokens == len(engine.canonicalizer.tokenize(DOCS[3]))
    assert full.usage.approx_tokens == 0
    with pytest.raises(InvalidRequestError, match="blend_recompute_ratio=1.5 is outside 0..1"):
        engine.generate(shuffled, reuse="blend", blend_recompute_ratio=1.5)
    with pytest.raises(InvalidRequestError, match="reuse='fuzzy' is not a reuse mode"):
        engine.generate(shuffled, reuse="fuzzy")  # type: ignore[arg-type]
