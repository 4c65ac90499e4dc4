"""The mask-free chunk attention equals SDPA with the explicit bottom-right causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag.chunk_attention import chunked_causal_attention


class _Module(torch.nn.Module):
    is_causal = True


def reference(q, k, v, scale=None):
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(("q_len", "past"), [(16, 0), (1, 40), (16, 40), (64, 7)])
def test_matches_masked_sdpa_fp32(heads, kv_heads, q_len, past):
    torch.manual_seed(0)
    q = torch.randn(1, heads, q_len, 32)
    k, v = torch.randn(2, 1, kv_heads, past + q_len, 32).unbind(0)
    out, weights = chunked_causal_attention(_Module(), q, k, v, None, scaling=0.2)
    assert weights is None and out.shape == (1, q_len, heads, 32)
    torch.testing.assert_close(out, reference(q, k, v, scale=0.2), atol=2e-5, rtol=1e-4)


def test_bf16_is_close_and_deterministic():
    torch.manual_seed(1)
    q = torch.randn(1, 9, 32, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 3, 96, 64, dtype=torch.bfloat16).unbind(0)
    a, _ = chunked_causal_attention(_Module(), q, k, v, None)
    b, _ = chunked_causal_attention(_Module(), q.clone(), k.clone(), v.clone(), None)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.float(), reference(q, k, v), atol=2e-2, rtol=2e-2)


def test_an_explicit_mask_is_honoured():
    """With a mask (padding, sliding windows) the function defers to transformers' SDPA path."""
    torch.manual_seed(2)
    q = torch.randn(1, 4, 8, 16)
    k, v = torch.randn(2, 1, 4, 8, 16).unbind(0)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 0] = True  # attend to the first key only
    out, _ = chunked_causal_attention(_Module(), q, k, v, mask)
    torch.testing.assert_close(out, v[:, :, :1].expand(1, 4, 8, 16).transpose(1, 2))
