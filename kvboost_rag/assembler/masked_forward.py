"""Forwards under an explicit mask, at any positions: a padded batch of rows over a batch cache
(:mod:`.batch_rows`), and blend mode's recompute of one row over its cache.

Layouts: ids and positions ``[rows, q]``; a mask bool ``[rows, 1, q, kv]`` (True: attend) over the
cache's slots and then the ``q`` new ones; ``slot_positions`` ``[rows, kv]``, the position of the
token in each slot; a shared prefix per layer ``(keys, values)`` ``[1, kv_heads, tokens,
head_dim]``; logits float32 ``[rows, vocab]`` of the last column.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from .. import chunk_attention
from .buffered_cache import BufferedCache
from .model_call import ModelCall


class MaskedForward:
    """The masked forwards of one model; ``window``: the smallest sliding window of any layer (None:
    every layer attends to all tokens); ``masks_by_type``: whether the model takes a batch's masks by
    layer type (else one mask for every layer)."""

    def __init__(self, call: ModelCall, *, window: int | None, masks_by_type: bool) -> None:
        self._call = call
        self._window = window
        self._masks_by_type = masks_by_type

    @property
    def shares_prefixes(self) -> bool:
        """Whether batches can keep a prefix common to all rows once (see :mod:`.batch_rows`)."""
        # the shared prefix is attended without a mask, so not by sliding-window layers
        return (
            self._window is None
            and self._call.attention.chunk is not None
            and chunk_attention.shared_prefix_available(self._call.device)
        )

    @torch.inference_mode()
    def rows(
        self,
        cache: Cache,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        shared: list[tuple[torch.Tensor, torch.Tensor]] | None,
        slot_positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """A padded batch's step (see :meth:`.Assembler.forward_rows`); float32 logits ``[rows, vocab]``."""
        inputs = self._call.inputs(
            token_ids, positions, cache, attention_mask=self._masks_by_layer(mask, positions, slot_positions)
        )
        call = self._call
        with call.lock, call.linears.every_linear():
            if shared is None:
                out = call.model(**inputs, logits_to_keep=1)
            else:
                with (
                    chunk_attention.shared_prefix(shared),
                    call.attention.use(chunk_attention.SHARED_PREFIX_NAME),
                ):
                    out = call.model(**inputs, logits_to_keep=1)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def one_row(
        self, cache: Cache, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One row's forward (see :meth:`.Assembler.forward_masked`); float32 logits ``[vocab]``."""
        # the position of the token in each slot: one slot per prompt token, then the q new ones
        slot_positions = torch.cat(
            (torch.arange(mask.shape[-1] - token_ids.shape[1], device=positions.device), positions[0])
        )[None]
        lean = self._call.lean_for(cache)
        if lean is None:
            return self.rows(cache, token_ids, positions, mask, None, slot_positions)[0]

        def masked(
            module: torch.nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            *_: Any,
            **kw: Any,
        ) -> tuple[torch.Tensor, None]:
            window = kw.get("sliding_window")
            layer_mask = mask if window is None else in_window(mask, positions, slot_positions, window)
            allowed = F.pad(
                layer_mask, (0, key.shape[2] - mask.shape[-1])
            )  # key blocks padded: never attended
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=allowed, scale=kw.get("scaling"), enable_gqa=True
            )
            return out.transpose(1, 2), None  # [1, q, heads, dim]

        assert isinstance(cache, BufferedCache)  # lean_for checked
        keep = torch.tensor([token_ids.shape[1] - 1], device=self._call.device)
        with self._call.lock:
            out = lean.forward(cache, token_ids, positions, masked, keep)
        assert out is not None
        return out[0]

    def _masks_by_layer(
        self, mask: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor | None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``mask`` for full-attention layers; on models with a sliding window, the same mask without
        the slots behind each query's window for the sliding layers (by layer type where the model
        names types, else the windowed mask for every layer)."""
        if self._window is None:
            return mask
        if slot_positions is None:
            raise ValueError("a batch over sliding-window layers needs the position of each cache slot")
        windowed = in_window(mask, positions, slot_positions, self._window)
        if not self._masks_by_type:
            return windowed
        return {"full_attention": mask, "sliding_attention": windowed}


def in_window(
    mask: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """``mask`` ``[rows, 1, q, kv]`` without the slots behind each query's sliding window: a query at p
    attends slots holding positions p - window < k (``positions`` ``[rows, q]``, ``slot_positions``
    ``[rows, kv]``)."""
    return mask & (slot_positions[:, None, None, :] > positions[:, None, :, None] - window)
