"""The Assembler: lays stored chunks into a cache, runs the model over it, cuts new KV back out.

Layouts:
- transformers cache layer: keys/values ``[batch, kv_heads, seq, head_dim]`` (batch 1 except in batches);
  our buffered layers (:mod:`.buffered_cache`) keep whole 512-key blocks and hand out views
- a stored chunk: ``[layers, 2, kv_heads, tokens, head_dim]``
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache

from .. import block_attention, chunk_attention
from .buffered_cache import BufferedCache, buffered_layers, kv_layers
from .lean_forward import LeanForward, kernel_tag, lean_forward_of

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
        self._masks_by_type = getattr(text, "layer_types", None) is not None
        """Whether the model takes a batch's masks by layer type (else one mask for every layer)."""
        # Forward calls of concurrent requests take turns: the attention switch below is shared
        # state of the model (also between engines that share it), and two calls at once would
        # only split the same cores.
        self._forward_lock = _model_lock(model)
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed ``past_key_values`` to ``cache``; accept either.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Over our own full-attention caches, SDPA models run chunk steps through the
        # mask-free chunk attention (same math, no [L, S] mask, causal work only).
        self._chunk_attention = (
            chunk_attention.register()
            if getattr(model.config, "_attn_implementation", None) == "sdpa"
            else None
        )
        self._block_attention = block_attention.register() if block_attention.available(self.device) else None
        self.invariant = False
        """Run forwards over buffered caches split-invariantly (set by the engine once the probe holds)."""
        text = model.config.get_text_config(decoder=True)
        self._query_groups = text.num_attention_heads // getattr(
            text, "num_key_value_heads", text.num_attention_heads
        )
        self._transposed_batch_weights = transposed_batch_weights
        self._transposed: dict[torch.nn.Linear, torch.Tensor] = {}  # [in, out] copies, made on first use
        self._lean_wanted = lean_forward and LeanForward.supports(model) is None
        self._lean: LeanForward | None = None  # made at the first split-invariant forward (packs weights)
        self._lean_tag = kernel_tag(model) if self._lean_wanted else ""

    @property
    def attention_kernel(self) -> str:
        """Names the attention arithmetic of prefill steps (part of the store namespace)."""
        if self.invariant:
            # every LM head product of these forwards runs a multiple of ROW_MULTIPLE rows (see forward)
            rows = block_attention.ROW_MULTIPLE
            kernel = f"{self._block_attention}-{block_attention.ARITHMETIC_TAG}-rows{rows}-head{rows}"
            return f"{kernel}-{self._lean_tag}" if self._lean_wanted else kernel
        return self._chunk_attention or str(getattr(self.model.config, "_attn_implementation", ""))

    @property
    def can_run_invariant(self) -> bool:
        """Whether the split-invariant attention exists for this model and device (the probe still
        decides)."""
        return self._block_attention is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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

    @torch.inference_mode()
    def forward_tail(
        self, cache: Cache, token_ids: Sequence[int], start: int, logit_rows: int, *, exact_rows: bool = True
    ) -> torch.Tensor | None:
        """:meth:`forward` returning float32 logits ``[logit_rows, vocab]`` of the last ``logit_rows``
        tokens (None for 0). In invariant mode row j's logits are the bits that a call ending at that
        token gives: drafted tokens are verified in one call with the logits of one call each."""
        n = len(token_ids)
        invariant = self.invariant and exact_rows and isinstance(cache, BufferedCache)
        rows = block_attention.round_up(n, block_attention.ROW_MULTIPLE) if invariant else n
        device = self.device
        ids = torch.tensor([[*token_ids, *[token_ids[-1]] * (rows - n)]], dtype=torch.long, device=device)
        positions = torch.arange(start, start + rows, device=device).unsqueeze(0)
        keep: int | torch.Tensor | None = None
        if logit_rows and invariant:
            # The LM head multiplies a multiple of ROW_MULTIPLE rows (the last wanted one repeated),
            # so its kernel, and each row's bits, are the same whatever the call and however many
            # rows it wants: a prefill's last logits, a decode step's, a verified draft's.
            wanted = list(range(n - logit_rows, n))
            wanted += [n - 1] * (
                block_attention.round_up(logit_rows, block_attention.ROW_MULTIPLE) - logit_rows
            )
            keep = torch.tensor(wanted, device=device)
        elif logit_rows:
            keep = logit_rows
        out: torch.Tensor | None = None
        with self._forward_lock:
            lean = self._lean_for(cache) if invariant else None
            if lean is not None:
                assert isinstance(cache, BufferedCache)  # _lean_for checked
                assert keep is None or isinstance(keep, torch.Tensor)
                with self._invariant_queries(cache, start, rows, real=n):
                    out = lean.forward(cache, ids, positions, block_attention.block_causal_attention, keep)
            else:
                kwargs = {
                    "input_ids": ids,
                    "position_ids": positions,
                    "use_cache": True,
                    self._cache_kwarg: cache,
                }
                head = (
                    self._decode_head() if n == 1 and not exact_rows and keep is not None else nullcontext()
                )
                with self._attention_for(cache, start, rows, n, invariant=exact_rows), head:
                    if keep is None:
                        self.model.base_model(**kwargs)
                    else:
                        out = self.model(**kwargs, logits_to_keep=keep).logits[0].float()
        if rows != n:
            assert isinstance(cache, BufferedCache)  # padded rows only in invariant mode, over our caches
            cache.truncate(start + n)
        return out[:logit_rows] if out is not None else None

    @torch.inference_mode()
    def forward_masked(
        self, cache: Cache, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Run one row of tokens at any ``positions`` over ``cache`` with an explicit ``mask`` (blend
        mode's recompute); float32 logits ``[vocab]`` of the last token.

        ``token_ids``/``positions``: ``[1, q]``; ``mask``: bool ``[1, 1, q, kv]`` (True: attend) over the
        cache's slots and then the ``q`` new ones. Through the lean forward where it runs (its packed
        products; the bits are not a prefill's, and need not be: the result is approximate anyway).
        """
        # the position of the token in each slot: one slot per prompt token, then the q new ones
        slot_positions = torch.cat(
            (torch.arange(mask.shape[-1] - token_ids.shape[1], device=positions.device), positions[0])
        )[None]
        lean = self._lean_for(cache)
        if lean is None:
            return self.forward_rows(cache, token_ids, positions, mask, slot_positions=slot_positions)[0]

        def masked(
            module: torch.nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            *_: Any,
            **kw: Any,
        ) -> tuple[torch.Tensor, None]:
            window = kw.get("sliding_window")
            layer_mask = mask if window is None else _in_window(mask, positions, slot_positions, window)
            allowed = F.pad(
                layer_mask, (0, key.shape[2] - mask.shape[-1])
            )  # key blocks padded: never attended
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=allowed, scale=kw.get("scaling"), enable_gqa=True
            )
            return out.transpose(1, 2), None  # [1, q, heads, dim]

        assert isinstance(cache, BufferedCache)  # _lean_for checked
        keep = torch.tensor([token_ids.shape[1] - 1], device=self.device)
        with self._forward_lock:
            out = lean.forward(cache, token_ids, positions, masked, keep)
        assert out is not None
        return out[0]

    def _lean_for(self, cache: Cache) -> LeanForward | None:
        """The lean forward for a split-invariant call over ``cache`` (made at first use), or None."""
        if not self._lean_wanted or not isinstance(cache, BufferedCache):
            return None
        if self._lean is None:
            self._lean = lean_forward_of(self.model)
        return self._lean

    @property
    def shares_prefixes(self) -> bool:
        """Whether batches can keep a prefix common to all rows once (see :mod:`.batch_rows`)."""
        # the shared prefix is attended without a mask, so not by sliding-window layers
        return (
            self.attention_window is None
            and self._chunk_attention is not None
            and chunk_attention.shared_prefix_available(self.device)
        )

    @torch.inference_mode()
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
        kwargs = {
            "input_ids": token_ids,
            "position_ids": positions,
            "attention_mask": self._masks_by_layer(mask, positions, slot_positions),
            "use_cache": True,
            self._cache_kwarg: cache,
        }
        with self._forward_lock, self._batch_linears():
            if shared is None:
                out = self.model(**kwargs, logits_to_keep=1)
            else:
                with (
                    chunk_attention.shared_prefix(shared),
                    self._attention_switch(chunk_attention.SHARED_PREFIX_NAME),
                ):
                    out = self.model(**kwargs, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _masks_by_layer(
        self, mask: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor | None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``mask`` for full-attention layers; on models with a sliding window, the same mask without
        the slots behind each query's window for the sliding layers (by layer type where the model
        names types, else the windowed mask for every layer)."""
        window = self.attention_window
        if window is None:
            return mask
        if slot_positions is None:
            raise ValueError("a batch over sliding-window layers needs the position of each cache slot")
        windowed = _in_window(mask, positions, slot_positions, window)
        if not self._masks_by_type:
            return windowed
        return {"full_attention": mask, "sliding_attention": windowed}

    @contextmanager
    def _batch_linears(self) -> Iterator[None]:
        """On CPU, run every linear layer of a batched step against a transposed copy of its weight.

        CPU BLAS multiplies a few rows by a ``[out, in]`` weight read transposed several times
        slower than by an ``[in, out]`` one (576x576 fp32, 8 rows: 0.37 ms against 0.05 ms;
        a whole SmolLM2 decode step of 8 rows: 151 ms against 113 ms). The copies cost the
        linear weights' size once. Only batched steps and decode steps come here (see
        :meth:`_decode_head`), never a prefill, so exact mode's stored KV is untouched; the swap
        is held under the forward lock only.
        """
        with self._row_major(m for m in self.model.modules() if type(m) is torch.nn.Linear):
            yield

    @contextmanager
    def _decode_head(self) -> Iterator[None]:
        """On CPU, the LM head of a one-token decode step against a transposed copy of its weight.

        For one row the layers' own products are as fast either way, but the LM head's is not
        (SmolLM2, 576 -> 49,152: 10.9 ms against 5.2 ms, a tenth of the step). Every decode step
        of every path goes through here, so a request's tokens are the same whether its prompt
        was reused or computed.
        """
        head = self.model.get_output_embeddings()
        with self._row_major([head] if type(head) is torch.nn.Linear else []):
            yield

    @contextmanager
    def _row_major(self, modules: Iterable[torch.nn.Linear]) -> Iterator[None]:
        """Inside, ``modules`` multiply by a transposed copy of their weight (made on first use and
        kept; subclasses such as quantized layers are never passed and keep their own forward)."""
        if not self._transposed_batch_weights or self.device.type != "cpu":
            yield
            return
        swapped = list(modules)
        for module in swapped:
            weight_t = self._transposed.get(module)
            if weight_t is None:
                with torch.no_grad():
                    weight_t = self._transposed[module] = module.weight.detach().t().contiguous()
            # An instance attribute shadows the class's forward until the del below.
            module.forward = functools.partial(  # type: ignore[method-assign]
                _row_major_linear, weight_t=weight_t, bias=module.bias
            )
        try:
            yield
        finally:
            for module in swapped:
                del module.forward

    @torch.inference_mode()
    def probe(
        self, cache: Cache, token_ids: Sequence[int], start: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, tokens, head_dim]`` that ``layer`` computes for ``token_ids`` at
        positions ``start..`` over ``cache``, running only the layers up to it; ``cache`` is left as it
        was."""
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
            self.forward(cache, token_ids, start, logits=False)
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

    @torch.inference_mode()
    def settle(self, cache: Cache, slots: torch.Tensor) -> None:
        """Move the KV appended last (one entry per slot) into ``slots`` and drop the appended tail.

        Selective recompute appends fresh KV for tokens whose stale KV sits earlier in the
        cache; afterwards every slot again holds the token at that position.
        """
        for lay in buffered_layers(cache):
            end = lay.get_seq_length()
            base = end - len(slots)
            # copies first: with one KV head PyTorch sees the source and the slots as overlapping
            lay._k[:, :, slots] = lay._k[:, :, base:end].clone()
            lay._v[:, :, slots] = lay._v[:, :, base:end].clone()
            lay.truncate(base)

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config(decoder=True).num_hidden_layers

    @contextmanager
    def _attention_for(
        self, cache: Cache, start: int, rows: int, real: int, *, invariant: bool
    ) -> Iterator[None]:
        """Select our attention for the duration of one forward of ``rows`` queries at ``start..``
        (the first ``real`` wanted, the rest filler rows) over a buffered cache: split-invariant in
        invariant mode (one-row decode steps excepted: ``invariant=False``), the chunk attention
        otherwise.

        The switch is on the shared config, so it is held only inside the call (under
        the forward lock), and the model is left as it was.
        """
        if not isinstance(cache, BufferedCache):
            yield
            return
        if self.invariant and invariant:
            assert self._block_attention is not None  # invariant mode is set only where it can run
            with (
                self._attention_switch(self._block_attention),
                self._invariant_queries(cache, start, rows, real=real),
            ):
                yield
            return
        if self._chunk_attention is None:
            yield
            return
        with self._attention_switch(self._chunk_attention):
            yield

    @contextmanager
    def _invariant_queries(self, cache: BufferedCache, start: int, rows: int, *, real: int) -> Iterator[None]:
        """Inside: the split-invariant attention's masks for ``rows`` queries at ``start..`` (the first
        ``real`` attended, the rest filler rows), and the cache handing out whole key blocks."""
        dtype = next(self.model.parameters()).dtype
        with (
            block_attention.queries_at(
                start,
                rows,
                self._query_groups,
                dtype,
                self.device,
                real=real,
                windows=self._windows,
                key_starts=cache.key_starts(),
            ),
            cache.keys_padded(),
        ):
            yield

    @contextmanager
    def _attention_switch(self, name: str) -> Iterator[None]:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = name
        try:
            with chunk_attention.owned():  # other threads' forwards meanwhile get plain SDPA
                yield
        finally:
            config._attn_implementation = previous

    @torch.inference_mode()
    def extract(self, cache: Cache, start: int, end: int) -> torch.Tensor:
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
    def append(self, cache: Cache, kv: torch.Tensor | Sequence[torch.Tensor]) -> None:
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


_FORWARD_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _in_window(
    mask: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """``mask`` ``[rows, 1, q, kv]`` without the slots behind each query's sliding window: a query at p
    attends slots holding positions p - window < k (``positions`` ``[rows, q]``, ``slot_positions``
    ``[rows, kv]``)."""
    return mask & (slot_positions[:, None, None, :] > positions[:, None, :, None] - window)


def _model_lock(model: torch.nn.Module) -> threading.Lock:
    """One forward lock per model object, shared by every assembler of that model (kept beside the
    model, not on it, so the model can still be copied)."""
    with _LOCKS_GUARD:
        return _FORWARD_LOCKS.setdefault(model, threading.Lock())


def _row_major_linear(x: torch.Tensor, *, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.Linear`` with the weight given as ``[in, out]``."""
    y = torch.matmul(x, weight_t)
    return y if bias is None else y + bias


class _ProbeDone(Exception):
    """Stops a probe forward once the probed layer has computed its keys and values."""
