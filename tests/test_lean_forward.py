"""The lean forward (kvboost_rag.assembler.lean_forward): the arithmetic of the model's own modules,
bitwise, for the model types it takes; the others keep the modules' path."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_VOCAB, tiny_model, tiny_tokenizer

from kvboost_rag import invariance
from kvboost_rag.assembler import Assembler
from kvboost_rag.assembler.lean_forward import LeanForward

TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    torch.bfloat16: {"rtol": 0.02, "atol": 0.05},
}
TEXT = "Retrieval augmented generation sends the same documents again and again. " * 12


def run(
    model: torch.nn.Module, ids: list[int], *, lean: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV of all tokens, the last logits of a long call, and the logits of a 5-token call after it."""
    assembler = Assembler(model, lean_forward=lean)
    assembler.invariant = True
    cache = assembler.new_cache(len(ids))
    last = assembler.forward(cache, ids[:-5], 0)
    tail = assembler.forward_tail(cache, ids[-5:], len(ids) - 5, 5)
    assert last is not None and tail is not None and tail.shape[0] == 5
    return assembler.extract(cache, 0, len(ids)), last, tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "llama-scaled-rope", "qwen2", "mistral"])
def test_the_lean_forward_computes_what_the_models_modules_compute(arch, dtype):
    """The same arithmetic: equal up to the rounding of the packed products (oneDNN's kernels may sum
    in another order than ``F.linear``'s; each path is split-invariant on its own, see the probe)."""
    model = tiny_model(arch, dtype)
    assert LeanForward.supports(model) is None
    ids = tiny_tokenizer().encode(TEXT)[:600]  # past one 512-key block
    for lean, modules in zip(run(model, ids, lean=True), run(model, ids, lean=False), strict=True):
        torch.testing.assert_close(lean.float(), modules.float(), **TOLERANCE[dtype])


def test_the_lean_forward_is_split_invariant():
    model = tiny_model("llama", torch.bfloat16)
    assembler = Assembler(model)
    report = invariance.check_split_invariance(assembler, TINY_VOCAB)
    assert report.holds, report.detail


@pytest.mark.parametrize("arch", ["phi3", "gemma", "gpt2"])
def test_other_model_types_say_why_they_keep_the_modules_path(arch):
    why = LeanForward.supports(tiny_model(arch))
    assert why is not None and "model type" in why


def test_the_store_namespace_names_the_lean_forward():
    assembler = Assembler(tiny_model("llama"))
    assembler.invariant = True
    lean_name = assembler.attention_kernel
    modules = Assembler(tiny_model("llama"), lean_forward=False)
    modules.invariant = True
    assert lean_name != modules.attention_kernel and "lean" in lean_name
