"""The mask-free chunk attention equals SDPA with the explicit bottom-right causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag.chunk_attention import chunked_causal_attention, shared_prefix, shared_prefix_attention


class _Module(torch.nn.Module):
    is_causal = True


def reference(q, k, v, scale=None):
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=scale
    ).transpose(1, 2)


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


@pytest.mark.parametrize(("heads", "kv_heads", "q_len"), [(4, 2, 1), (9, 3, 5), (4, 4, 3)])
def test_shared_prefix_attention_equals_attention_over_each_rows_full_keys(heads, kv_heads, q_len):
    """Rows that attend to one shared prefix plus their own masked slots give what plain SDPA gives
    over each row's copy of the prefix followed by its slots (rounding aside)."""
    torch.manual_seed(0)
    rows, prefix, own, dim = 3, 40, 7, 16
    query = torch.randn(rows, heads, q_len, dim)
    shared_k, shared_v = torch.randn(1, kv_heads, prefix, dim), torch.randn(1, kv_heads, prefix, dim)
    key, value = torch.randn(rows, kv_heads, own, dim), torch.randn(rows, kv_heads, own, dim)
    mask = torch.rand(rows, 1, q_len, own) > 0.4
    mask[..., -1] = True  # every query sees at least its own slot
    module = torch.nn.Module()
    module.layer_idx = 0
    with shared_prefix([(shared_k, shared_v)]):
        out, _ = shared_prefix_attention(module, query, key, value, mask)
    full_k = torch.cat([shared_k.expand(rows, -1, -1, -1), key], dim=2).repeat_interleave(
        heads // kv_heads, dim=1
    )
    full_v = torch.cat([shared_v.expand(rows, -1, -1, -1), value], dim=2).repeat_interleave(
        heads // kv_heads, dim=1
    )
    full_mask = torch.cat([torch.ones(rows, 1, q_len, prefix, dtype=torch.bool), mask], dim=3)
    expected = F.scaled_dot_product_attention(query, full_k, full_v, attn_mask=full_mask).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
