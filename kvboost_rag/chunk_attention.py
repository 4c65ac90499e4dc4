"""Causal attention for one prefill chunk over a cache, without a materialized mask.

A chunk of ``L`` queries at the end of ``S`` cached keys attends to every past
key and causally to its own keys. SDPA's ``is_causal`` aligns the triangle to
the top-left, so transformers builds an explicit ``[L, S]`` mask for this case,
which costs the mask itself, a copy of K/V per layer for grouped-query heads,
and attention work on the masked half of the chunk's own block. Here the two
parts run as separate flash-attention calls (past: full; own block: causal) and
are merged exactly with their log-sum-exp weights.

Registered with transformers' attention interfaces under :data:`ATTENTION_NAME`;
the assembler selects it only for calls over its own full-attention caches.

For batches whose rows share a prompt prefix, :data:`SHARED_PREFIX_NAME` keeps
that prefix once instead of once per row: every query of every row attends to
it in one call that reads it once (rows folded into the query axis), the rows'
own keys are attended with their mask, and the two parts are merged the same way.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_NAME = "kvboost_chunked_sdpa"
SHARED_PREFIX_NAME = "kvboost_shared_prefix_sdpa"

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
"""transformers' attention interface: ``(module, query, key, value, attention_mask, dropout=0.0,
scaling=None, **kwargs)`` with ``query [B, H, L, D]``, ``key``/``value`` ``[B, KV, S, D]``;
returns ``(output [B, L, H, D], weights or None)``."""


@dataclass(frozen=True)
class AttentionCall:
    """The arguments of one attention-interface call."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    dropout: float
    scaling: float | None
    options: dict[str, Any]
    """Further keyword arguments (``softcap``, ``position_bias``, ...)."""

    def sdpa(self) -> tuple[torch.Tensor, Any]:
        """transformers' own SDPA attention over these arguments."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            self.module,
            self.query,
            self.key,
            self.value,
            self.attention_mask,
            self.dropout,
            self.scaling,
            **self.options,
        )


def attention_function(kernel: Callable[[AttentionCall], tuple[torch.Tensor, Any]]) -> AttentionFunction:
    """``kernel`` with transformers' attention-interface signature (see :data:`AttentionFunction`)."""

    @functools.wraps(kernel)
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        return kernel(AttentionCall(module, query, key, value, attention_mask, dropout, scaling, kwargs))

    return attention


_flash_cpu: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)
"""PyTorch's CPU flash attention, returning ``(output, logsumexp)``; None where this build lacks it."""


def _merge_past_and_block(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``query [B, H, L, D]`` over ``key/value [B, KV, S, D]`` with the last L keys its own (CPU flash)."""
    assert _flash_cpu is not None  # called only where it exists
    batch, heads, q_len, dim = query.shape
    kv_heads, past = key.shape[1], key.shape[2] - q_len
    groups = heads // kv_heads
    # Past part: no mask, so the query heads of each KV group can be folded into the
    # sequence axis ([B, KV, groups*L, D]); the shared past keys are then read in place.
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    out_past, lse_past = _flash_cpu(folded, key[:, :, :past], value[:, :, :past], scale=scale)
    out_past = out_past.reshape(batch, heads, q_len, -1)
    lse_past = lse_past.reshape(batch, heads, q_len)
    # Own block: causal and square, so is_causal is exactly right; expand its (few) keys.
    block_k = key[:, :, past:].repeat_interleave(groups, dim=1)
    block_v = value[:, :, past:].repeat_interleave(groups, dim=1)
    out_block, lse_block = _flash_cpu(query, block_k, block_v, is_causal=True, scale=scale)
    # softmax over the union = weighted mean of the two partial softmaxes
    return merge_partial_softmax(out_past, lse_past, out_block, lse_block).to(query.dtype)


def _one_query(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """One query per head (``[B, H, 1, D]``) over every key, the heads of each KV group folded into the
    query axis (``[B, KV, groups, D]``): the group's keys are read once, in place. On CPU this is
    several times faster than SDPA's grouped-query path for one token (SmolLM2, 986 keys, bfloat16:
    0.16 ms against 0.72 ms a layer; the same bits in bfloat16 at the sizes checked, 1 to 4,097 keys,
    and within ~1e-7 in float32)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(folded, key, value, scale=scale)
    return out.reshape(batch, heads, 1, value.shape[-1])


@attention_function
def chunked_causal_attention(call: AttentionCall) -> tuple[torch.Tensor, Any]:
    """Causal attention of the last L keys' queries over all S keys (see the module docstring)."""
    query, key, value, scaling = call.query, call.key, call.value, call.scaling
    options = call.options
    special = (
        call.attention_mask is not None or options.get("position_bias") is not None or options.get("softcap")
    )
    heads, kv_heads = query.shape[1], key.shape[1]
    if special or call.dropout or key.shape[-1] != value.shape[-1] or heads % kv_heads:
        return call.sdpa()
    q_len, past = query.shape[2], key.shape[2] - query.shape[2]
    gqa = heads != kv_heads
    if q_len == 1:  # one token attending to everything: a decode step
        out = _one_query(query, key, value, scaling)
    elif past == 0:  # plain causal prefill
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    elif _flash_cpu is not None and query.device.type == "cpu":
        out = _merge_past_and_block(query, key, value, scaling)
    else:
        mask = torch.ones(q_len, key.shape[2], dtype=torch.bool, device=query.device).tril(past)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def merge_partial_softmax(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax over the union of two key sets from each part's output and log-sum-exp ``[..., L]``."""
    top = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - top).unsqueeze(-1)
    w_b = torch.exp(lse_b - top).unsqueeze(-1)
    return (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)


@contextmanager
def thread_value(local: threading.local, name: str, value: object) -> Iterator[None]:
    """Set ``local.<name>`` to ``value`` on this thread for the block inside; the previous value after."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


_shared = threading.local()


def shared_prefix_available(device: torch.device) -> bool:
    """Whether :func:`shared_prefix_attention` can run on ``device`` (it uses the CPU flash kernel)."""
    return _flash_cpu is not None and device.type == "cpu"


@contextmanager
def shared_prefix(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Make ``(keys, values)`` ``[1, kv_heads, P, head_dim]`` per layer the shared prefix of the calls
    inside."""
    with thread_value(_shared, "layers", layers):
        yield


@attention_function
def shared_prefix_attention(call: AttentionCall) -> tuple[torch.Tensor, None]:
    """``query [B, H, L, D]`` over the shared prefix and each row's own ``key/value [B, KV, S, D]``
    under ``attention_mask`` (bool ``[B, 1, L, S]``, True: attend); returns ``[B, L, H, D]``."""
    assert _flash_cpu is not None  # selected only where it exists (shared_prefix_available)
    attention_mask = call.attention_mask
    assert attention_mask is not None  # batches always pass their own mask
    query, key, value, scaling = call.query, call.key, call.value, call.scaling
    shared_k, shared_v = _shared.layers[call.module.layer_idx]  # [1, KV, P, D]
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # Shared part: no mask, so all rows' queries of a KV group fold into one sequence axis.
    folded = query.reshape(batch, kv_heads, groups * q_len, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    out_shared, lse_shared = _flash_cpu(folded, shared_k, shared_v, scale=scaling)
    out_shared = (
        out_shared.reshape(kv_heads, batch, groups * q_len, -1)
        .transpose(0, 1)
        .reshape(batch, heads, q_len, -1)
    )
    lse_shared = (
        lse_shared.reshape(kv_heads, batch, groups * q_len).transpose(0, 1).reshape(batch, heads, q_len)
    )
    # Rows' own part: few keys, so expand them to the query heads and apply the mask.
    bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
    bias.masked_fill_(~attention_mask, float("-inf"))
    out_rows, lse_rows = _flash_cpu(
        query,
        key.repeat_interleave(groups, dim=1),
        value.repeat_interleave(groups, dim=1),
        attn_mask=bias,
        scale=scaling,
    )
    merged = merge_partial_softmax(out_shared, lse_shared, out_rows, lse_rows).to(query.dtype)
    return merged.transpose(1, 2).contiguous(), None


_owner = threading.local()


@contextmanager
def owned() -> Iterator[None]:
    """Mark the forward inside (on this thread) as ours: our attention and mask functions apply.

    The model's config names our attention while one of our forwards runs. A forward that
    another thread runs over the same model meanwhile (``model.generate`` while the engine
    stores a reply in the background) is not ours, and gets plain SDPA and its mask.
    """
    with thread_value(_owner, "active", True):
        yield


def for_others(attention: AttentionFunction) -> AttentionFunction:
    """``attention`` in our forwards, transformers' SDPA in anyone else's."""

    @functools.wraps(attention)
    def dispatch(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if getattr(_owner, "active", False):
            return attention(*args, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(*args, **kwargs)

    return dispatch


def mask_for_others(*args: Any, **kwargs: Any) -> Any:
    """Mask function of our attention names: none in our forwards (our functions mask by
    themselves, or take the batch's own 4D mask), SDPA's in anyone else's."""
    if getattr(_owner, "active", False):
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, for_others(chunked_causal_attention))
    AttentionMaskInterface.register(ATTENTION_NAME, mask_for_others)
    # Batches pass their own 4D masks, which transformers hands through unchanged.
    AttentionInterface.register(SHARED_PREFIX_NAME, for_others(shared_prefix_attention))
    AttentionMaskInterface.register(SHARED_PREFIX_NAME, mask_for_others)
    return ATTENTION_NAME
