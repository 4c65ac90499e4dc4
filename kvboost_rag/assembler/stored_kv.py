"""Stored KV in and out of a cache: lay stored chunks after what a cache holds, cut a run of tokens
back out, and settle recomputed KV into the slots of the tokens it replaces.

Layouts: a stored chunk ``[layers, 2, kv_heads, tokens, head_dim]`` (keys at 0, values at 1); a
cache layer's keys and values ``[batch, kv_heads, seq, head_dim]``, batch 1 here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from .buffered_cache import BufferedCache, buffered_layers, kv_layers


@torch.inference_mode()
def extract(cache: Cache, start: int, end: int) -> torch.Tensor:
    """KV of tokens ``start:end`` as ``[layers, 2, kv_heads, tokens, head_dim]`` (a copy)."""
    held_from = cache.held_from if isinstance(cache, BufferedCache) else 0
    if start < held_from:
        msg = f"tokens {start}:{end} are not all held: the cache dropped the positions before {held_from}"
        raise ValueError(msg)
    layers = kv_layers(cache)
    slots = [start - getattr(layer, "start", 0) for layer in layers]  # [slot of ``start`` per layer]
    return torch.stack(
        [
            torch.stack((layer.keys[0, :, s : s + end - start], layer.values[0, :, s : s + end - start]))
            for layer, s in zip(layers, slots, strict=True)
        ]
    )


@torch.inference_mode()
def append(cache: Cache, kv: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """Lay stored chunks ``[layers, 2, kv_heads, tokens, head_dim]`` (one, or several in order)
    after what ``cache`` holds."""
    parts = [kv] if isinstance(kv, torch.Tensor) else list(kv)
    for part in parts:
        if part.shape[0] != len(cache.layers):
            msg = f"stored chunk has {part.shape[0]} layers, the model has {len(cache.layers)}"
            raise ValueError(msg)
    if isinstance(cache, BufferedCache):
        for layer_idx, buffered in enumerate(buffered_layers(cache)):
            buffered.extend([p[layer_idx, 0] for p in parts], [p[layer_idx, 1] for p in parts])
        return
    for layer_idx, layer in enumerate(kv_layers(cache)):
        if len(parts) == 1:
            keys, values = parts[0][layer_idx, 0], parts[0][layer_idx, 1]
        else:  # a few large copies per layer rather than a small one per chunk and layer
            keys = torch.cat([p[layer_idx, 0] for p in parts], dim=1)
            values = torch.cat([p[layer_idx, 1] for p in parts], dim=1)
        layer.update(keys.unsqueeze(0), values.unsqueeze(0))


@torch.inference_mode()
def settle(cache: Cache, slots: torch.Tensor) -> None:
    """Move the KV appended last (one entry per slot) into ``slots`` and drop the appended tail.

    Selective recompute appends fresh KV for tokens whose stale KV sits earlier in the
    cache; afterwards every slot again holds the token at that position.
    """
    for layer in buffered_layers(cache):
        layer.settle(slots)
