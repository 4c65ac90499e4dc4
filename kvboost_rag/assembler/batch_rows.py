"""The rows of a batch cache: prefixes laid as rows, rows kept or joined, a prefix shared by all rows.

A batch decodes several requests over one :class:`.BufferedCache` of ``rows`` rows. Each row keeps
its own tokens from slot 0; a shorter row is padded with zero slots, masked by the batch, so that
every row's next token goes to one common slot. A prefix that every row holds identically can be
taken out and attended once for all rows (``shared``, see :meth:`.Assembler.forward_rows`).

Layouts: buffers ``[rows, kv_heads, capacity, head_dim]``; a shared prefix per layer ``(keys,
values)`` ``[1, kv_heads, tokens, head_dim]``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .. import block_attention
from .buffered_cache import BufferedCache, buffered_layers, kv_layers


def shared_prefix(cache: Cache, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``tokens`` of a one-row cache, per layer ``(keys, values)``
    ``[1, kv_heads, tokens, head_dim]``."""
    return [(layer.keys[:, :, :tokens], layer.values[:, :, :tokens]) for layer in kv_layers(cache)]


@torch.inference_mode()
def batch_cache(
    num_layers: int, prefixes: list[tuple[Cache | None, int]], capacity: int, skip: int = 0
) -> Cache:
    """A cache of ``len(prefixes)`` rows: row i holds tokens ``skip:n_i`` of its prefix cache from
    slot 0, zeros (to be masked) up to the longest prefix; ``skip`` tokens are shared and kept apart.

    The buffers past the longest prefix are left unwritten (see :mod:`.buffered_cache`)."""
    cache = BufferedCache(num_layers, capacity)
    width = max(n for _, n in prefixes) - skip
    source = next((c for c, n in prefixes if n), None)
    if source is None or width == 0:
        return cache  # nothing to lay: the first forward initialises the buffers
    for layer_idx, layer in enumerate(buffered_layers(cache)):
        ref = kv_layers(source)[layer_idx].keys  # [1, kv_heads, seq, head_dim]
        keys = ref.new_empty(len(prefixes), ref.shape[1], capacity, ref.shape[3])
        values = keys.new_empty(keys.shape)
        for row, (prefix, n) in enumerate(prefixes):
            own = max(n - skip, 0)
            if own:
                assert prefix is not None  # a prefix of n > 0 tokens has its cache
                keys[row, :, :own] = kv_layers(prefix)[layer_idx].keys[0, :, skip:n]
                values[row, :, :own] = kv_layers(prefix)[layer_idx].values[0, :, skip:n]
            keys[row, :, own:width] = 0  # masked, and read
            values[row, :, own:width] = 0
        layer.set_buffers(keys, values, width)
    return cache


def keep_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Drop every row of a batch cache but ``rows`` (finished requests leave the batch)."""
    for layer in buffered_layers(cache):
        kept = []
        for buffer in (layer._k, layer._v):
            new = buffer.new_empty(len(rows), *buffer.shape[1:])
            new[:, :, : layer.length] = buffer[rows, :, : layer.length]  # the slots held, not the rest
            kept.append(new)
        layer.set_buffers(kept[0], kept[1], layer.length)


@torch.inference_mode()
def join_rows(cache: Cache, joining: Cache, capacity: int) -> None:
    """Lay the rows of batch cache ``joining`` after those of ``cache`` (new requests join a batch),
    in buffers of at least ``capacity`` slots.

    Both keep their slots from 0; the shorter one is padded with zero slots (to be masked) to
    the longer's length, so that the next token of every row goes to one common slot.
    """
    for layer, other in zip(buffered_layers(cache), buffered_layers(joining), strict=True):
        length = max(layer.length, other.length)
        size = block_attention.round_up(max(capacity, length), block_attention.KEY_BLOCK)
        rows = layer._k.shape[0] + other._k.shape[0]
        merged = []
        for mine, theirs in ((layer._k, other._k), (layer._v, other._v)):
            buffer = mine.new_empty(rows, mine.shape[1], size, mine.shape[3])
            ours, joined = buffer[: mine.shape[0]], buffer[mine.shape[0] :]
            ours[:, :, : layer.length] = mine[:, :, : layer.length]
            ours[:, :, layer.length : length] = 0  # masked, and read
            joined[:, :, : other.length] = theirs[:, :, : other.length]
            joined[:, :, other.length : length] = 0
            merged.append(buffer)
        layer.set_buffers(merged[0], merged[1], length)


@torch.inference_mode()
def share_prefix(cache: Cache, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Take the first ``tokens`` slots of a one-row cache out, as a prefix to share (from then on
    passed to :meth:`.Assembler.forward_rows`); the row keeps its later slots, from slot 0. The inverse of
    :func:`unshare_prefix`. Returns per layer ``(keys, values)`` ``[1, kv_heads, tokens, head_dim]``."""
    layers = buffered_layers(cache)
    length = layers[0].length  # the same in every layer
    if layers[0]._k.shape[0] != 1 or not 0 < tokens <= length:
        msg = f"share_prefix takes 1 to {length} leading slots of a one-row cache, not {tokens}"
        raise ValueError(msg)
    shared = []
    for layer in layers:
        size = block_attention.round_up(max(layer.capacity - tokens, 1), block_attention.KEY_BLOCK)
        prefix, own = [], []
        for buffer in (layer._k, layer._v):
            kept = buffer.new_empty(1, buffer.shape[1], size, buffer.shape[3])
            kept[:, :, : length - tokens] = buffer[:, :, tokens:length]
            prefix.append(buffer[:, :, :tokens].clone())
            own.append(kept)
        layer.set_buffers(own[0], own[1], length - tokens)
        shared.append((prefix[0], prefix[1]))
    return shared


@torch.inference_mode()
def unshare_prefix(cache: Cache, shared: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy a shared prefix (from :func:`share_prefix`) into the first slots of every row of batch
    ``cache``, before the row's own slots: the rows no longer need it passed to
    :meth:`.Assembler.forward_rows`."""
    for layer, (shared_keys, shared_values) in zip(buffered_layers(cache), shared, strict=True):
        tokens, length = shared_keys.shape[2], layer.length
        size = block_attention.round_up(layer.capacity + tokens, block_attention.KEY_BLOCK)
        merged = []
        for own, prefix in ((layer._k, shared_keys), (layer._v, shared_values)):
            buffer = own.new_empty(own.shape[0], own.shape[1], size, own.shape[3])
            buffer[:, :, :tokens] = prefix  # [1, kv_heads, tokens, head_dim] to every row
            buffer[:, :, tokens : tokens + length] = own[:, :, :length]
            merged.append(buffer)
        layer.set_buffers(merged[0], merged[1], tokens + length)
