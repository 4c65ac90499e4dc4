"""RoPE re-rotation: keys moved to new positions equal keys computed there."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from kvboost_rag.assembler import Assembler
from kvboost_rag.errors import UnsupportedModelError
from kvboost_rag.rope import RopeShifter, blend_blocker

ROPE_SETTINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "rope_theta": 500000.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 512,
    },
}
TOKENS = [5, 17, 99, 230, 7, 61, 42, 300, 11, 128, 3, 77]
# float32 keys through different rotation paths agree to rounding: |k| ~ 10 here, errors ~1e-5.
ATOL = 1e-4


def layer0_keys(assembler: Assembler, start: int) -> torch.Tensor:
    """KV ``[layers, 2, kv_heads, tokens, head_dim]`` of TOKENS computed at positions ``start..``
    with nothing before."""
    cache = assembler.new_cache(len(TOKENS))
    assembler.forward(cache, TOKENS, start, logits=False)
    return assembler.extract(cache, 0, len(TOKENS))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", list(ROPE_SETTINGS))
@pytest.mark.parametrize(("old", "new"), [(0, 37), (300, 1200), (900, 5)])
def test_moved_keys_equal_keys_computed_there(arch: str, rope: str, old: int, new: int) -> None:
    model = tiny_model(arch, rope_parameters=ROPE_SETTINGS[rope])
    assembler = Assembler(model)
    shifter = RopeShifter(model)
    moved = shifter.move(layer0_keys(assembler, old), old, new)
    there = layer0_keys(assembler, new)
    # Layer 0 sees only the tokens themselves, so its keys differ by position alone.
    torch.testing.assert_close(moved[0, 0], there[0, 0], atol=ATOL, rtol=0)
    assert torch.equal(moved[:, 1], layer0_keys(assembler, old)[:, 1])  # values carry no position
    # the move did something
    assert not torch.allclose(layer0_keys(assembler, old)[0, 0], there[0, 0], atol=ATOL)


def test_longrope_moves_within_its_short_regime_only() -> None:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 512,
        "short_factor": [1.0 + i / 16 for i in range(8)],
        "long_factor": [2.0 + i / 8 for i in range(8)],
    }
    model = tiny_model(
        "phi3", rope_parameters=rope, max_position_embeddings=2048, original_max_position_embeddings=512
    )
    assembler = Assembler(model)
    shifter = RopeShifter(model)
    assert shifter.can_move(100, 500) and not shifter.can_move(100, 600)
    moved = shifter.move(layer0_keys(assembler, 40), 40, 400)
    torch.testing.assert_close(moved[0, 0], layer0_keys(assembler, 400)[0, 0], atol=ATOL, rtol=0)


def test_partial_rotary_dims_are_left_alone() -> None:
    model = tiny_model(
        "phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    )
    assert model.model.rotary_emb.inv_freq.numel() == 4  # 8 of 16 head dims rotate
    assembler = Assembler(model)
    moved = RopeShifter(model).move(layer0_keys(assembler, 3), 3, 250)
    there = layer0_keys(assembler, 250)
    torch.testing.assert_close(moved[0, 0], there[0, 0], atol=ATOL, rtol=0)
    assert torch.equal(moved[0, 0, :, :, 8:], layer0_keys(assembler, 3)[0, 0, :, :, 8:])


def test_dynamic_ntk_and_models_without_rope_are_refused() -> None:
    dynamic = tiny_model(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    assert "changes its frequencies" in (blend_blocker(dynamic) or "")
    with pytest.raises(UnsupportedModelError, match="reuse='exact'"):
        RopeShifter(dynamic)
    with pytest.raises(UnsupportedModelError, match="'gpt2' models are not supported"):
        RopeShifter(tiny_model("gpt2"))


@pytest.mark.parametrize(("old", "new"), [(0, 37), (300, 1200)])
def test_per_layer_type_frequencies_move_each_layer_by_its_own(old: int, new: int) -> None:
    """Gemma 3: sliding layers rotate with a local base, global layers with another. A prompt's keys
    depend on relative positions only, so every layer's moved keys equal keys computed there."""
    model = tiny_model("gemma3")
    params = model.config.rope_parameters
    assert params["sliding_attention"]["rope_theta"] != params["full_attention"]["rope_theta"]
    assembler = Assembler(model)
    moved = RopeShifter(model).move(layer0_keys(assembler, old), old, new)
    torch.testing.assert_close(moved[:, 0], layer0_keys(assembler, new)[:, 0], atol=ATOL, rtol=1e-4)
