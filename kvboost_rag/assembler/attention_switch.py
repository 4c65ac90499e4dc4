"""Which attention a forward over our caches runs: the split-invariant one, the chunk attention, or
the model's own.

transformers picks a layer's attention by the name in ``config._attn_implementation``; our
attentions are registered under names of their own (:mod:`..chunk_attention`,
:mod:`..block_attention`) and selected by switching that name for the duration of one call.
The config is shared state of the model (also between engines that share it), so a switch is
held only inside a call, under the forward lock, and the model is left as it was.

Layout: while the split-invariant attention runs, the cache hands out keys and values padded to
whole key blocks, ``[batch, kv_heads, blocks * KEY_BLOCK, head_dim]`` (see :mod:`.buffered_cache`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from transformers.cache_utils import Cache

from .. import block_attention, chunk_attention
from .buffered_cache import BufferedCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class AttentionSwitch:
    """Our attentions for one model, registered once, and the switches that select them."""

    def __init__(self, model: PreTrainedModel, windows: Collection[int | None]) -> None:
        self._model = model
        self._windows = windows
        # Over our own full-attention caches, SDPA models run chunk steps through the
        # mask-free chunk attention (same math, no [L, S] mask, causal work only).
        self.chunk = (
            chunk_attention.register()
            if getattr(model.config, "_attn_implementation", None) == "sdpa"
            else None
        )
        """The chunk attention's name, or None where the model does not run SDPA."""
        device = next(model.parameters()).device
        self.block = block_attention.register() if block_attention.available(device) else None
        """The split-invariant attention's name, or None where it cannot run on this device."""
        text = model.config.get_text_config(decoder=True)
        self._query_groups = text.num_attention_heads // getattr(
            text, "num_key_value_heads", text.num_attention_heads
        )

    @contextmanager
    def for_call(
        self, cache: Cache, start: int, rows: int, real: int, *, split_invariant: bool
    ) -> Iterator[None]:
        """Select our attention for the duration of one forward of ``rows`` queries at ``start..``
        (the first ``real`` wanted, the rest filler rows) over a buffered cache: split-invariant
        where the call is (``split_invariant``: invariant mode, one-row decode steps excepted), the
        chunk attention otherwise. Over any other cache the model's own attention runs."""
        if not isinstance(cache, BufferedCache):
            yield
            return
        if split_invariant:
            assert self.block is not None  # invariant mode is set only where it can run
            with self.use(self.block), self.invariant_queries(cache, start, rows, real=real):
                yield
            return
        if self.chunk is None:
            yield
            return
        with self.use(self.chunk):
            yield

    @contextmanager
    def invariant_queries(self, cache: BufferedCache, start: int, rows: int, *, real: int) -> Iterator[None]:
        """Inside: the split-invariant attention's masks for ``rows`` queries at ``start..`` (the first
        ``real`` attended, the rest filler rows), and the cache handing out whole key blocks."""
        parameter = next(self._model.parameters())
        with (
            block_attention.queries_at(
                start,
                rows,
                self._query_groups,
                parameter.dtype,
                parameter.device,
                real=real,
                windows=self._windows,
                key_starts=cache.key_starts(),
            ),
            cache.keys_padded(),
        ):
            yield

    @contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Inside, the model's layers run the attention registered as ``name``."""
        config = self._model.config
        previous = config._attn_implementation
        config._attn_implementation = name
        try:
            with chunk_attention.owned():  # other threads' forwards meanwhile get plain SDPA
                yield
        finally:
            config._attn_implementation = previous
