"""The split-invariant attention: the math of causal attention, and bits that do not depend on the split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag import block_attention
from kvboost_rag.block_attention import KEY_BLOCK, block_causal_attention, queries_at, round_up

HEADS, KV_HEADS, DIM = 6, 2, 16
pytestmark = pytest.mark.skipif(
    not block_attention.available(torch.device("cpu")), reason="needs the CPU flash kernel"
)


def keys_and_values(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, n, DIM, generator=g).to(dtype)
    k = torch.randn(1, KV_HEADS, n, DIM, generator=g).to(dtype)
    v = torch.randn(1, KV_HEADS, n, DIM, generator=g).to(dtype)
    return q, k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Queries ``start:end`` over keys ``:end``, with the keys padded to whole blocks (as the cache does)."""
    padded = round_up(end, KEY_BLOCK)
    pad = (0, 0, 0, padded - end)
    with queries_at(start, end - start, HEADS // KV_HEADS, q.dtype, q.device):
        out, _ = block_causal_attention(
            torch.nn.Module(), q[:, :, start:end], F.pad(k[:, :, :end], pad), F.pad(v[:, :, :end], pad), None
        )
    return out  # [1, L, H, D]


@pytest.mark.parametrize("n", [5, 300, 700, 1100])
def test_equals_causal_attention(n):
    q, k, v = keys_and_values(n, torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(q, k, v, 0, n), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cuts", [(1,), (511, 513), (3, 500, 700, 1023), (1099,), (64, 128, 1024)])
def test_rows_do_not_depend_on_the_split(cuts, dtype):
    n = 1100
    q, k, v = keys_and_values(n, dtype)
    whole = attend(q, k, v, 0, n)
    parts = [attend(q, k, v, a, b) for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_runs_only_inside_queries_at():
    q, k, v = keys_and_values(8, torch.float32)
    with pytest.raises(RuntimeError, match="queries_at"):
        block_causal_attention(torch.nn.Module(), q, k, v, None)


def test_refuses_what_it_cannot_compute():
    q, k, v = keys_and_values(8, torch.float32)
    with (
        queries_at(0, 8, HEADS // KV_HEADS, q.dtype, q.device),
        pytest.raises(NotImplementedError, match="soft"),
    ):
        block_causal_attention(torch.nn.Module(), q, k, v, None, softcap=30.0)


def test_other_threads_forwards_get_plain_sdpa_while_ours_runs():
    """While one of our forwards has the model's config switched to our attention, a forward another thread
    runs over the same model (``model.generate`` beside a background job) gets plain SDPA and its mask."""
    import threading

    from helpers import tiny_model

    from kvboost_rag.assembler import Assembler

    model = tiny_model("llama")
    ids = torch.tensor([[5, 9, 13, 21, 34, 55, 89, 144]])
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    assembler = Assembler(model)
    results = []
    for name in (block_attention.register(), "kvboost_chunked_sdpa"):
        with assembler._attention_switch(name):  # as during one of our forwards on this thread
            assert model.config._attn_implementation == name
            worker = threading.Thread(target=lambda: results.append(_generate(model, ids)))
            worker.start()
            worker.join()
    assert len(results) == 2 and all(torch.equal(r, expected) for r in results)


def _generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=6, do_sample=False)
