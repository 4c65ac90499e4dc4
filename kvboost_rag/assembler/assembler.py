"""The Assembler: lays stored chunks into a cache, runs the model over it, cuts new KV back out.

This module is the facade: it reads the model's config once, owns the invariant mode, names the
attention arithmetic, makes caches, and hands each call to the module that does that job:

- :mod:`.request_forward`: a request's next tokens at consecutive positions (split-invariant in
  invariant mode);
- :mod:`.masked_forward`: forwards under an explicit mask (a batch of rows, blend's recompute);
- :mod:`.layer_probe`: one layer's keys and values, the cache left as it was;
- :mod:`.stored_kv`: stored chunks into a cache and back out;
- :mod:`.model_call`: what those forwards share (forward lock, :mod:`.attention_switch`,
  :mod:`.row_major` linears, the lean forward).

Layouts:
- transformers cache layer: keys/values ``[batch, kv_heads, seq, head_dim]`` (batch 1 except in batches);
  our buffered layers (:mod:`.buffered_cache`) keep whole 512-key blocks and hand out views
- a stored chunk: ``[layers, 2, kv_heads, tokens, head_dim]``
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicCache

from .. import block_attention
from . import stored_kv
from .buffered_cache import BufferedCache
from .layer_probe import probe_layer
from .lean_forward import kernel_tag
from .masked_forward import MaskedForward
from .model_call import ModelCall
from .request_forward import forward_tail

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


def _attention_window(config: PreTrainedConfig) -> int | None:
    """Smallest sliding window of any layer, or None when every layer attends to all tokens."""
    return min((w for w in block_attention.layer_windows(config) if w is not None), default=None)


class Assembler:
    """Cache assembly and forward calls for one loaded model."""

    def __init__(
        self, model: PreTrainedModel, *, transposed_batch_weights: bool = True, lean_forward: bool = True
    ) -> None:
        self.model = model
        self.config = model.config
        text = model.config.get_text_config(decoder=True)
        self.context_window = getattr(text, "max_position_embeddings", None) or getattr(
            text, "n_positions", None
        )
        self.attention_window = _attention_window(model.config)
        # every window a layer may pass to the split-invariant attention (the config's own too: a
        # module that applies it to every layer whatever its type then finds its masks)
        self._layer_windows = block_attention.layer_windows(model.config)
        self._windows = {*self._layer_windows, getattr(text, "sliding_window", None)}
        self._call = ModelCall(
            model,
            windows=self._windows,
            transposed_batch_weights=transposed_batch_weights,
            lean_forward=lean_forward,
        )
        self._masked = MaskedForward(
            self._call,
            window=self.attention_window,
            masks_by_type=getattr(text, "layer_types", None) is not None,
        )
        self.invariant = False
        """Run forwards over buffered caches split-invariantly (set by the engine once the probe holds)."""
        self._lean_tag = kernel_tag(model) if self._call.lean_wanted else ""

    @property
    def attention_kernel(self) -> str:
        """Names the attention arithmetic of prefill steps (part of the store namespace)."""
        if self.invariant:
            # every LM head product of these forwards runs a multiple of ROW_MULTIPLE rows (see forward)
            rows = block_attention.ROW_MULTIPLE
            kernel = f"{self._call.attention.block}-{block_attention.ARITHMETIC_TAG}-rows{rows}-head{rows}"
            return f"{kernel}-{self._lean_tag}" if self._call.lean_wanted else kernel
        return self._call.attention.chunk or str(getattr(self.model.config, "_attn_implementation", ""))

    @property
    def can_run_invariant(self) -> bool:
        """Whether the split-invariant attention exists for this model and device (the probe still
        decides)."""
        return self._call.attention.block is not None

    @property
    def device(self) -> torch.device:
        return self._call.device

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config(decoder=True).num_hidden_layers

    def exact_reuse_blocker(self, total_tokens: int) -> str | None:
        """Why exact chunk reuse cannot serve a sequence of ``total_tokens``, or None.

        The split-invariant attention applies each layer's sliding window, so on sliding-window and
        hybrid models reuse is exact at any length. The canonical schedule's attention does not:
        there, reuse stays exact while the sequence fits in the smallest window, and beyond it the
        request runs as plain generation through the model's own cache.
        """
        window = self.attention_window
        if window is None or total_tokens <= window or self.invariant:
            return None
        return (
            f"the model uses sliding-window attention (window {window} tokens) and this request needs "
            f"{total_tokens}; past the window, chunk reuse needs the split-invariant attention, which "
            "this platform's probe did not confirm"
        )

    def batch_blocker(self, total_tokens: int) -> str | None:
        """Why a sequence of ``total_tokens`` cannot decode in a batch, or None. A batch masks each
        layer type on its own (:meth:`forward_rows`), which takes one window size: a model whose
        layers use several decodes sequences past the smallest one alone."""
        window, windows = self.attention_window, {w for w in self._windows if w is not None}
        if window is not None and total_tokens > window and len(windows) > 1:
            return (
                f"the model's layers use several sliding windows ({sorted(windows)}); past {window} tokens "
                "a request decodes alone"
            )
        return self.exact_reuse_blocker(total_tokens)

    def new_cache(
        self, capacity: int, *, reusable: bool = True, stop: threading.Event | None = None
    ) -> Cache:
        """An empty cache: buffered full-attention layers, or the model's own layers for plain generation.

        Once ``stop`` is set, a forward over a buffered cache raises ``CancelledError`` at its next layer.
        """
        if not reusable:
            return DynamicCache(config=self.config)
        return BufferedCache(self.num_layers, capacity, stop, self._layer_windows)

    def forward(
        self,
        cache: Cache,
        token_ids: Sequence[int],
        start: int,
        *,
        logits: bool = True,
        exact_rows: bool = True,
    ) -> torch.Tensor | None:
        """Run ``token_ids`` at positions ``start..`` over ``cache``.

        Returns float32 logits ``[vocab]`` of the last token, or None with ``logits=False``,
        which skips the LM head (a full read of the vocabulary matrix per call).

        In invariant mode the call is padded with filler rows to a multiple of
        ``ROW_MULTIPLE`` (their KV is dropped afterwards), so each token's KV and logits are
        the same bits however the prompt is split into calls. ``exact_rows=False`` skips the
        padding (one-row decode steps where the split-invariant forward does not run).
        """
        out = self.forward_tail(cache, token_ids, start, 1 if logits else 0, exact_rows=exact_rows)
        return out[-1] if out is not None else None

    def forward_tail(
        self, cache: Cache, token_ids: Sequence[int], start: int, logit_rows: int, *, exact_rows: bool = True
    ) -> torch.Tensor | None:
        """:meth:`forward` returning float32 logits ``[logit_rows, vocab]`` of the last ``logit_rows``
        tokens (None for 0). In invariant mode row j's logits are the bits that a call ending at that
        token gives: drafted tokens are verified in one call with the logits of one call each."""
        return forward_tail(
            self._call, cache, token_ids, start, logit_rows, invariant=self.invariant, exact_rows=exact_rows
        )

    def forward_masked(
        self, cache: Cache, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Run one row of tokens at any ``positions`` over ``cache`` with an explicit ``mask`` (blend
        mode's recompute); float32 logits ``[vocab]`` of the last token.

        ``token_ids``/``positions``: ``[1, q]``; ``mask``: bool ``[1, 1, q, kv]`` (True: attend) over the
        cache's slots and then the ``q`` new ones. Through the lean forward where it runs (its packed
        products; the bits are not a prefill's, and need not be: the result is approximate anyway).
        """
        return self._masked.one_row(cache, token_ids, positions, mask)

    @property
    def shares_prefixes(self) -> bool:
        """Whether batches can keep a prefix common to all rows once (see :mod:`.batch_rows`)."""
        return self._masked.shares_prefixes

    def forward_rows(
        self,
        cache: Cache,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        shared: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        slot_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a padded batch over a batch cache; returns float32 logits ``[rows, vocab]`` of the last column.

        ``token_ids``/``positions``: ``[rows, q]``; ``mask``: bool ``[rows, 1, q, kv]`` (True: attend) over
        the rows' own cache slots. ``shared``: a prefix (from :func:`.batch_rows.share_prefix`) that every row
        attends to before its own slots, kept once for all rows (requires :attr:`shares_prefixes`).
        ``slot_positions`` ``[rows, kv]``: the position of the token in each slot (any value for masked
        slots); needed on models with sliding-window layers, whose masks also leave out the slots
        behind the window.
        """
        return self._masked.rows(cache, token_ids, positions, mask, shared, slot_positions)

    def probe(
        self, cache: Cache, token_ids: Sequence[int], start: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, tokens, head_dim]`` that ``layer`` computes for ``token_ids`` at
        positions ``start..`` over ``cache``, running only the layers up to it; ``cache`` is left as it
        was."""
        return probe_layer(cache, layer, lambda: self.forward(cache, token_ids, start, logits=False))

    def extract(self, cache: Cache, start: int, end: int) -> torch.Tensor:
        """KV of tokens ``start:end`` as ``[layers, 2, kv_heads, tokens, head_dim]`` (a copy)."""
        return stored_kv.extract(cache, start, end)

    def append(self, cache: Cache, kv: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Lay stored chunks ``[layers, 2, kv_heads, tokens, head_dim]`` (one, or several in order)
        after what ``cache`` holds."""
        stored_kv.append(cache, kv)

    def settle(self, cache: Cache, slots: torch.Tensor) -> None:
        """Move the KV appended last (one entry per slot) into ``slots`` and drop the appended tail
        (blend's recompute; see :func:`.stored_kv.settle`)."""
        stored_kv.settle(cache, slots)

    @property
    def _transposed(self) -> dict[torch.nn.Linear, torch.Tensor]:
        """The row-major weight copies made so far (tests count them)."""
        return self._call.linears.transposed

    def _attention_switch(self, name: str) -> AbstractContextManager[None]:
        """Inside, the model runs the attention registered as ``name`` (tests switch it by hand)."""
        return self._call.attention.use(name)
