"""Probing one layer: the keys and values a layer computes for some tokens, the cache left as it was.

Blend mode compares them with the stored KV to choose the tokens it recomputes. The forward stops
at the probed layer (the later layers never run) and every layer is cut back to its length before.

Layout: the probed layer's keys and values ``[kv_heads, tokens, head_dim]`` (the cache's
``[1, kv_heads, tokens, head_dim]`` without its batch axis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

from .buffered_cache import buffered_layers


@torch.inference_mode()
def probe_layer(cache: Cache, layer: int, run: Callable[[], object]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values that ``layer`` computes during ``run`` (a forward over ``cache``, stopped
    there); ``cache`` is left as it was."""
    layers = buffered_layers(cache)
    lengths = [lay.get_seq_length() for lay in layers]
    target = layers[layer]
    captured: list[torch.Tensor] = []

    def capture(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        captured.extend((key_states[0].clone(), value_states[0].clone()))
        raise _ProbeDone

    # an instance attribute shadows the method for this call only
    target.update = capture  # type: ignore[method-assign]
    try:
        run()
    except _ProbeDone:
        pass
    finally:
        del target.update
        for lay, n in zip(layers, lengths, strict=True):
            lay.truncate(n)
    if not captured:
        msg = f"layer {layer} was never reached (the model has {len(cache.layers)} layers)"
        raise ValueError(msg)
    return captured[0], captured[1]


class _ProbeDone(Exception):
    """Stops a probe forward once the probed layer has computed its keys and values."""
