"""Split-invariant causal attention: the KV and output of token i depend on tokens <= i only.

A prefill that reuses a stored prefix runs the remaining tokens as one forward
over the cache; a cold prefill runs all tokens at once. For both to give the
same bits, every operation must compute a token's row the same way whatever
other rows share the call. Two facts measured on CPU (``../shared/probes``):

- matrix products give rows bitwise independent of the row count once the
  count is a multiple of 8 (small counts take other kernels), so the assembler
  pads every invariant forward to a multiple of :data:`ROW_MULTIPLE` rows;
- PyTorch's CPU flash attention walks the keys in blocks of 512; a partial last
  block changes the reduction, whole blocks (extra keys masked) do not.

So the keys are cut into fixed blocks of :data:`KEY_BLOCK` from position 0. A
query at position p in key block b = p // KEY_BLOCK attends, in one flash call,
to the keys of the blocks up to its own, ``0 .. (b + 1) * KEY_BLOCK``, with keys
after p (and the slots past the cache's end) masked: the same keys, the same
blocks and the same mask row for every query of block b, whatever call it is in.
(One call with a mask over all those keys costs less than the past blocks and
the own block as two calls whose softmaxes are merged: SmolLM2, a decode step
at 1K tokens, 30.7 against 33.5 ms; a 4K prefill reads the larger mask, ~3 %
slower.)

The query heads of each KV group are folded into the row axis, so grouped-query
models read their keys in place, and the folded rows of a block are padded to a
multiple of :data:`ROW_MULTIPLE` (the flash kernel, like the matrix products,
gives a row the same bits in any call of such a size). The filler rows that the
assembler adds for its matrix products (``count - real`` in :func:`queries_at`)
are not attended at all: attention costs about its folded rows (SmolLM2, 3,584
keys: 9 rows 0.42 ms a call, 24 rows 0.77 ms), so a one-token step attends 8
folded rows, not the 24 of 8 padded rows x 3 heads.

Sliding-window layers (a query at p attends keys p - window < k <= p, as transformers masks
them) keep the same construction with a window-dependent first block: a query of block b
attends the keys from block ``first_key_block(b, window)`` on, the oldest block any query of b
can reach, with the keys outside its window masked. Again the same keys, blocks and mask row
for every query of block b in any call; whole blocks behind the window are skipped, so a
sliding layer costs about two blocks of keys however long the prompt. A cache may drop those
blocks (see ``BufferedCache.drop_behind``): the keys it hands over then start at a later position,
which :func:`queries_at` is told (``key_starts``, by layer); the flash calls read the same keys.

Whether the platform really behaves so is checked at load by
:mod:`kvboost_rag.invariance`; where it does not, the engine uses the canonical
chunk schedule instead (:mod:`kvboost_rag.chunk_attention`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .chunk_attention import (
    AttentionCall,
    attention_function,
    for_others,
    mask_for_others,
    thread_value,
)

ATTENTION_NAME = "kvboost_block_sdpa"
ARITHMETIC_TAG = "span1"
"""Names this attention's arithmetic in the store namespace; bump it whenever that changes."""
KEY_BLOCK = 512
"""Keys per block of the CPU flash kernel (its ``kvSplitSize``)."""
ROW_MULTIPLE = 8
"""Row counts that are multiples of this take the same matrix kernels as long prefills."""

_flash_cpu: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)
"""PyTorch's CPU flash attention, returning ``(output, logsumexp)``; None where this build lacks it."""


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``.

    >>> round_up(700, 512), round_up(1024, 512), round_up(1, 8)
    (1024, 1024, 8)
    """
    return -(-n // multiple) * multiple


def available(device: torch.device) -> bool:
    """Whether the split-invariant attention can run on ``device`` (it needs the CPU flash kernel)."""
    return _flash_cpu is not None and device.type == "cpu"


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window as transformers' modules apply it (None: full attention)."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    layers = text.num_hidden_layers
    if window is None or getattr(text, "use_sliding_window", True) is False:
        return [None] * layers
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def first_key_block(block: int, window: int | None) -> int:
    """The first key block that queries of key block ``block`` attend: 0 for full attention, else
    the block of the oldest key in the window of the block's first query.

    >>> first_key_block(3, None), first_key_block(3, 512), first_key_block(3, 128), first_key_block(0, 128)
    (0, 2, 2, 0)
    """
    if window is None:
        return 0
    return max(0, (block * KEY_BLOCK - window + 1) // KEY_BLOCK)


@dataclass(frozen=True)
class _QueryBlock:
    """Query rows ``lo:hi`` of a call, all in key block ``block``, with their mask."""

    lo: int
    hi: int
    block: int
    first: int
    """The first key they attend (a multiple of ``KEY_BLOCK``)."""
    mask: torch.Tensor
    """Additive ``[1, 1, folded rows, (block + 1) * KEY_BLOCK - first]``: 0 where the query may attend,
    -inf elsewhere; the ``groups * (hi - lo)`` folded rows padded to a multiple of ``ROW_MULTIPLE``."""


_state = threading.local()


@contextmanager
def queries_at(
    start: int,
    count: int,
    groups: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    real: int | None = None,
    windows: Iterable[int | None] = (None,),
    key_starts: Sequence[int] | None = None,
) -> Iterator[None]:
    """Declare that the forward inside runs ``count`` queries at positions ``start..``, of which the
    first ``real`` (default: all) are wanted; the others are filler rows, whose attention output
    is zeros (it only has to be finite: their KV is dropped after the call).

    The masks depend on the positions only, so they are built once here for every layer: one set
    per attention window the model's layers use (None: full attention). ``groups`` is the number
    of query heads per KV head. ``key_starts``: by layer index, the position of the first key the
    layer is handed (a whole number of key blocks; default: every layer's keys from position 0).
    """
    wanted = count if real is None else real
    blocks = {window: _query_blocks(start, wanted, groups, dtype, device, window) for window in windows}
    with thread_value(_state, "blocks", blocks), thread_value(_state, "key_starts", key_starts):
        yield


def _query_blocks(
    start: int, wanted: int, groups: int, dtype: torch.dtype, device: torch.device, window: int | None
) -> list[_QueryBlock]:
    blocks = []
    lo = 0
    while lo < wanted:
        block = (start + lo) // KEY_BLOCK
        hi = min(wanted, (block + 1) * KEY_BLOCK - start)
        first = first_key_block(block, window) * KEY_BLOCK
        keys = torch.arange(first, (block + 1) * KEY_BLOCK, device=device)  # the blocks it may reach
        positions = torch.arange(start + lo, start + hi, device=device)  # [n]
        mask = torch.zeros(hi - lo, len(keys), dtype=dtype, device=device)
        mask.masked_fill_(keys[None, :] > positions[:, None], float("-inf"))
        if window is not None:
            mask.masked_fill_(keys[None, :] <= positions[:, None] - window, float("-inf"))
        folded = mask.repeat(groups, 1)  # [groups * n, keys]: each KV group's query heads as rows
        padded = F.pad(
            folded, (0, 0, 0, round_up(len(folded), ROW_MULTIPLE) - len(folded))
        )  # pad rows see all
        blocks.append(_QueryBlock(lo, hi, block, first, padded[None, None]))
        lo = hi
    return blocks


@attention_function
def block_causal_attention(call: AttentionCall) -> tuple[torch.Tensor, None]:
    """Split-invariant causal attention.

    ``query [B, H, L, D]`` at the positions declared by :func:`queries_at`; ``key``/``value``
    ``[B, KV, S, D]`` are the cache buffers padded to whole key blocks (masked slots hold
    finite values). Returns ``[B, L, H, D]``.
    """
    query, key, value, scaling = call.query, call.key, call.value, call.scaling
    by_window = getattr(_state, "blocks", None)
    if by_window is None:
        msg = f"{ATTENTION_NAME} runs only inside queries_at(); the assembler selects it for its own forwards"
        raise RuntimeError(msg)
    window = call.options.get("sliding_window")
    if window not in by_window:
        msg = (
            f"{ATTENTION_NAME}: a layer attends a window of {window} tokens that queries_at() did not declare"
        )
        raise RuntimeError(msg)
    blocks = by_window[window]
    key_starts = getattr(_state, "key_starts", None)
    key_start = key_starts[call.module.layer_idx] if key_starts else 0
    if blocks and blocks[0].first < key_start:
        msg = (
            f"{ATTENTION_NAME}: queries attend keys from position {blocks[0].first}, "
            f"but the cache dropped those before {key_start}"
        )
        raise RuntimeError(msg)
    if (
        call.dropout
        or call.options.get("softcap")
        or call.options.get("position_bias") is not None
        or key.shape[-1] != value.shape[-1]
    ):
        msg = (
            f"{type(call.module).__name__} needs attention features (soft-capping, position bias, dropout) "
            f"that {ATTENTION_NAME} lacks"
        )
        raise NotImplementedError(msg)
    assert _flash_cpu is not None  # registered only where it exists (available)
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_empty(batch, q_len, heads, value.shape[-1])
    wanted = blocks[-1].hi if blocks else 0
    if wanted < q_len:
        out[:, wanted:] = 0  # filler rows, not attended
    for qb in blocks:
        n = qb.hi - qb.lo
        rows = groups * n
        folded = query[:, :, qb.lo : qb.hi].reshape(batch, kv_heads, rows, dim)  # heads of a KV group as rows
        if qb.mask.shape[2] != rows:
            folded = F.pad(folded, (0, 0, 0, qb.mask.shape[2] - rows))
        first, end = qb.first - key_start, (qb.block + 1) * KEY_BLOCK - key_start  # slots of the cache
        o, _ = _flash_cpu(
            folded, key[:, :, first:end], value[:, :, first:end], attn_mask=qb.mask, scale=scaling
        )
        # [B, KV, groups * n, D] -> [B, n, KV, groups, D] = [B, n, H, D], in one copy
        unfolded = o[:, :, :rows].unflatten(2, (groups, n)).permute(0, 3, 1, 2, 4)
        out[:, qb.lo : qb.hi].view(batch, n, kv_heads, groups, -1).copy_(unfolded)
    return out, None


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, for_others(block_causal_attention))
    AttentionMaskInterface.register(ATTENTION_NAME, mask_for_others)
    return ATTENTION_NAME
