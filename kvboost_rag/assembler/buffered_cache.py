"""The cache our forwards run over: preallocated buffers that grow in whole key blocks.

Layout: each layer keeps keys and values ``[batch, kv_heads, capacity, head_dim]`` with ``capacity``
a whole number of 512-key blocks, and hands attention views of the first ``seq`` slots (or of whole
key blocks, for the split-invariant attention). Growing in place avoids the copy per forward of a
concatenating cache.

The buffers start as empty memory, not zeros: the operating system then maps (and clears) a page
only when a slot in it is first written, which matters because a fresh zero-filled buffer costs
its whole size in page faults (a batch join of 8 rows: ~190 MB, ~0.2 s on a 2-core machine).
Attention over ``seq`` slots reads no further; the split-invariant attention reads the rest of the
last key block (masked), and those slots are zeroed first, so every slot read is finite.

A sliding-window layer may drop the key blocks that no query from a given position on can attend
(:meth:`BufferedCache.drop_behind`): its slot 0 then holds position ``start`` (a whole number of
key blocks), so a long request keeps about its window per sliding layer, as transformers' own
sliding-window cache does. Positions stay the cache's unit (``get_seq_length``, ``truncate``);
slots are positions minus ``start``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .. import block_attention


class BufferedLayer(DynamicLayer):
    """A full-attention layer that appends into a preallocated buffer.

    transformers' ``DynamicLayer`` concatenates on every update, which copies the
    whole past on each prefill step and each decoded token; writing into a
    buffer that grows geometrically makes appends cost only the new tokens.
    """

    def __init__(self, capacity: int, stop: threading.Event | None = None, window: int | None = None) -> None:
        super().__init__()
        self.capacity = block_attention.round_up(max(capacity, 1), block_attention.KEY_BLOCK)
        """Slots of the buffers."""
        self.length = 0
        """Positions held or dropped: the next token goes to position ``length``."""
        self.start = 0
        """The position in slot 0: the key blocks before it were dropped (sliding-window layers only)."""
        self.window = window
        """The sliding window of the layer (None: full attention, nothing is ever dropped)."""
        self.pad_keys = False
        """Return the keys and values padded to whole key blocks (for the split-invariant attention)."""
        self.stop = stop
        """Once set, the next update raises ``CancelledError``: a forward over this cache then ends
        within one layer's work, however long its prompt."""
        self.finite = 0
        """Slots below this hold written values or zeros; those from it on may hold anything."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, dim = key_states.shape
        self._k = key_states.new_empty(batch, heads, self.capacity, dim)
        self._v = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
        self.finite = 0
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        capacity = block_attention.round_up(max(needed, 2 * self.capacity), block_attention.KEY_BLOCK)
        self._move(self.start, capacity)

    def _move(self, start: int, capacity: int) -> None:
        """Copy positions ``start:length`` into new buffers of ``capacity`` slots, from slot 0."""
        held = self.length - start
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :held] = old[:, :, start - self.start : self.length - self.start]
            setattr(self, name, new)
        self.start, self.capacity, self.finite = start, capacity, held
        self._views()

    def _views(self) -> None:
        held = self.length - self.start
        self.keys, self.values = self._k[:, :, :held], self._v[:, :, :held]

    def drop_behind(self, position: int, keep_from: int | None = None) -> None:
        """Drop the key blocks that no query at ``position`` or later attends (a sliding-window layer
        only), but none from ``keep_from`` on; the buffers shrink to what is left, plus a key block
        of room."""
        if self.window is None or not self.is_initialized:
            return
        block = block_attention.KEY_BLOCK
        start = block_attention.first_key_block(position // block, self.window) * block
        if keep_from is not None:
            start = min(start, keep_from // block * block)
        if start <= self.start:
            return
        self._move(start, block_attention.round_up(self.length - start, block) + block)

    def restore_dropped(self) -> None:
        """Hold every position from 0 again, the dropped ones as zeros (for attention that masks them
        by position, as batches do: they lie behind every later query's window)."""
        if self.start == 0:
            return
        dropped, held = self.start, self.length - self.start
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], self.capacity + dropped, old.shape[3])
            new[:, :, :dropped] = 0
            new[:, :, dropped : dropped + held] = old[:, :, :held]
            setattr(self, name, new)
        self.start, self.capacity, self.finite = 0, self.capacity + dropped, self.length
        self._views()

    def _zero_to(self, slot: int) -> None:
        """Make every slot below ``slot`` finite (zeros where nothing was written)."""
        if slot > self.finite:
            self._k[:, :, self.finite : slot] = 0
            self._v[:, :, self.finite : slot] = 0
            self.finite = slot

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stop is not None and self.stop.is_set():
            raise CancelledError("the request was cancelled")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first, end = self.length - self.start, self.length - self.start + key_states.shape[-2]  # slots
        if end > self.capacity:
            self._grow(end)
        self._k[:, :, first:end] = key_states
        self._v[:, :, first:end] = value_states
        self.length, self.finite = self.start + end, max(self.finite, end)
        self._views()
        if self.pad_keys:
            padded = block_attention.round_up(end, block_attention.KEY_BLOCK)
            self._zero_to(padded)  # the masked rest of the last key block is read
            return self._k[:, :, :padded], self._v[:, :, :padded]
        return self._k[:, :, :end], self._v[:, :, :end]

    def extend(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append several runs of stored tokens ``[kv_heads, tokens, head_dim]`` in order.

        One concatenation per buffer, written straight into its slots: one copy of each byte, and one
        kernel call where a copy per run pays a call each (8K tokens in 64-token chunks: 125 runs)."""
        first = self.length - self.start
        end = first + sum(k.shape[-2] for k in keys)
        if not self.is_initialized:
            self.lazy_initialization(keys[0].unsqueeze(0), values[0].unsqueeze(0))
        if end > self.capacity:
            self._grow(end)
        torch.cat(list(keys), dim=-2, out=self._k[0, :, first:end])
        torch.cat(list(values), dim=-2, out=self._v[0, :, first:end])
        self.length, self.finite = self.start + end, max(self.finite, end)
        self._views()

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        if not self.is_initialized:
            return
        if length < self.start:
            msg = f"cannot go back to position {length}: the positions before {self.start} were dropped"
            raise ValueError(msg)
        self.length = length
        self._views()

    def settle(self, slots: torch.Tensor) -> None:
        """Move the last ``len(slots)`` positions into ``slots`` and forget them (see
        :func:`.stored_kv.settle`)."""
        end = self.get_seq_length()
        base = end - len(slots)
        # copies first: with one KV head PyTorch sees the source and the slots as overlapping
        self._k[:, :, slots] = self._k[:, :, base:end].clone()
        self._v[:, :, slots] = self._v[:, :, base:end].clone()
        self.truncate(base)

    def set_buffers(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Adopt ``[rows, kv_heads, capacity, head_dim]`` buffers whose first ``length`` slots are filled
        (finite) with positions ``0:length``; the slots after them may hold anything."""
        self.device = keys.device
        self._k, self._v = keys, values
        self.start, self.capacity, self.length, self.finite = 0, keys.shape[2], length, length
        self._views()
        self.is_initialized = True


class KVLayer(Protocol):
    """What we use of a full-attention cache layer that holds tokens (transformers' or ours)."""

    keys: torch.Tensor  # [batch, kv_heads, seq, head_dim]
    values: torch.Tensor

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def kv_layers(cache: Cache) -> list[KVLayer]:
    """The layers of a cache made by :meth:`Assembler.new_cache` or :func:`.batch_rows.batch_cache`.

    transformers types them loosely (``keys`` may be None, layers may be linear attention); ours
    are full-attention layers, read only once they hold tokens.
    """
    return cast("list[KVLayer]", cache.layers)


def buffered_layers(cache: Cache) -> list[BufferedLayer]:
    """The layers of a buffered cache (:class:`BufferedCache`: every cache of a reusable prefill
    or a batch)."""
    return cast("list[BufferedLayer]", cache.layers)


class BufferedCache(DynamicCache):
    """A ``DynamicCache`` (models check for that type) made of buffered layers; with ``stop``, a
    forward over it raises ``CancelledError`` at its next layer once ``stop`` is set."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        stop: threading.Event | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        windows = windows if windows is not None else [None] * num_layers
        Cache.__init__(self, layers=[BufferedLayer(capacity, stop, window) for window in windows])

    def drop_behind(self, position: int, keep_from: int | None = None) -> None:
        """Drop, in every sliding-window layer, the key blocks that no query at ``position`` or later
        attends, keeping every position from ``keep_from`` on (see :meth:`BufferedLayer.drop_behind`)."""
        for layer in buffered_layers(self):
            layer.drop_behind(position, keep_from)

    def restore_dropped(self) -> None:
        """Every layer holds every position from 0 again (dropped ones as zeros)."""
        for layer in buffered_layers(self):
            layer.restore_dropped()

    def stop_on(self, stop: threading.Event | None) -> None:
        """Forwards over this cache raise ``CancelledError`` at their next layer once ``stop`` is set
        (None: never); a cache that goes on to serve another request takes that request's."""
        for layer in buffered_layers(self):
            layer.stop = stop

    def key_starts(self) -> list[int]:
        """The position in slot 0 of each layer."""
        return [layer.start for layer in buffered_layers(self)]

    @property
    def held_from(self) -> int:
        """The first position every layer still holds."""
        return max((layer.start for layer in buffered_layers(self)), default=0)

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on, in every layer."""
        for layer in buffered_layers(self):
            layer.truncate(length)

    @contextmanager
    def keys_padded(self) -> Iterator[None]:
        """Inside, layers hand attention their keys and values padded to whole key blocks."""
        for layer in buffered_layers(self):
            layer.pad_keys = True
        try:
            yield
        finally:
            for layer in buffered_layers(self):
                layer.pad_keys = False
