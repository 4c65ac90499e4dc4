"""The lean forward's glue (kvboost_rag.assembler.native_glue): the compiled functions give the
PyTorch ops' bits where they do the same operations in the same order (residual adds, RoPE), the
RMSNorm within rounding of them, every row the same bits in any call; a machine without a compiler
runs the PyTorch ops, and the store namespace tells the two apart."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from helpers import TINY_VOCAB, tiny_model

from kvboost_rag import invariance
from kvboost_rag.assembler import Assembler, native_glue
from kvboost_rag.assembler.native_glue import NativeGlue, RMSNorm, TorchGlue

DTYPES = [torch.float32, torch.bfloat16]
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


@pytest.fixture
def compiled() -> NativeGlue:
    glue = native_glue.native_glue()
    assert glue is not None, "a C compiler is installed, so the glue must build"
    return glue


@pytest.fixture
def without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine where the glue is switched off (or could not be built)."""
    monkeypatch.setattr(native_glue, "_LOADED", [None])


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 8, 37])
def test_rope_split_gives_the_pytorch_ops_bits(compiled, dtype, rows):
    torch.manual_seed(rows)
    heads, kv_heads, dim = 6, 2, 32
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * dim).to(dtype) * 4
    cos, sin = torch.randn(1, rows, dim).to(dtype), torch.randn(1, rows, dim).to(dtype)
    for native, ops in zip(
        compiled.rope_split(qkv, cos, sin, heads, kv_heads),
        TorchGlue().rope_split(qkv, cos, sin, heads, kv_heads),
        strict=True,
    ):
        assert native.shape == ops.shape
        assert torch.equal(native, ops)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_add_norm_adds_bitwise_and_normalizes_within_rounding(compiled, dtype):
    torch.manual_seed(0)
    residual, delta = torch.randn(1, 24, 200).to(dtype) * 3, torch.randn(1, 24, 200).to(dtype)
    norm = RMSNorm(torch.rand(200).to(dtype) + 0.5, 1e-6)
    total, normed = compiled.add_norm(residual, delta, norm)
    ops_total, ops_normed = TorchGlue().add_norm(residual, delta, norm)
    assert torch.equal(total, ops_total)
    # the row's squares are summed in another order: at most the last bit of the scale differs
    tolerance = {"rtol": 1.6e-2, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(normed, ops_normed, **tolerance)
    torch.testing.assert_close(compiled.norm(residual, norm), TorchGlue().norm(residual, norm), **tolerance)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_every_row_gets_the_same_bits_in_any_call(compiled, dtype):
    torch.manual_seed(1)
    residual, delta = torch.randn(1, 19, 96).to(dtype), torch.randn(1, 19, 96).to(dtype)
    norm = RMSNorm(torch.rand(96).to(dtype), 1e-5)
    whole = compiled.add_norm(residual, delta, norm)[1]
    for lo, hi in [(0, 1), (3, 11), (18, 19)]:
        assert torch.equal(compiled.add_norm(residual[:, lo:hi], delta[:, lo:hi], norm)[1], whole[:, lo:hi])


@needs_compiler
def test_the_lean_forward_runs_the_compiled_glue_split_invariantly(compiled):
    assembler = Assembler(tiny_model("llama", torch.bfloat16))
    report = invariance.check_split_invariance(assembler, TINY_VOCAB)
    assert report.holds, report.detail
    assembler.invariant = True
    assert assembler.attention_kernel.endswith(f"-{native_glue.NATIVE_TAG}")


def test_without_the_compiled_glue_the_pytorch_ops_run_and_are_named_apart(without_native):
    model = tiny_model("llama", torch.bfloat16)
    assembler = Assembler(model)
    assert isinstance(native_glue.glue_for(torch.bfloat16, torch.device("cpu")), TorchGlue)
    report = invariance.check_split_invariance(assembler, TINY_VOCAB)
    assert report.holds, report.detail
    assembler.invariant = True
    assert not assembler.attention_kernel.endswith(native_glue.NATIVE_TAG)


def test_a_failing_compiler_falls_back_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native_glue, "_LOADED", [])
    monkeypatch.setenv("KVBOOST_RAG_HOME", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level(logging.WARNING, logger=native_glue.__name__):
        assert native_glue.native_glue() is None
    assert "could not be built" in caplog.text and native_glue.DISABLE_ENV in caplog.text
    assert isinstance(native_glue.glue_for(torch.float32, torch.device("cpu")), TorchGlue)


def test_the_switch_turns_the_compiled_glue_off(monkeypatch):
    monkeypatch.setattr(native_glue, "_LOADED", [])
    monkeypatch.setenv(native_glue.DISABLE_ENV, "0")
    assert native_glue.native_glue() is None
    assert isinstance(native_glue.glue_for(torch.bfloat16, torch.device("cpu")), TorchGlue)


def test_float16_runs_the_pytorch_ops():
    assert isinstance(native_glue.glue_for(torch.float16, torch.device("cpu")), TorchGlue)
