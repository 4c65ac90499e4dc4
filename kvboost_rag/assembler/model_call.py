"""How our forwards call one loaded model: one call at a time, the cache under the model's own
keyword, our attention switched in, the lean forward where it runs.

Both forward modules (:mod:`.request_forward`, :mod:`.masked_forward`) go through one
:class:`ModelCall`; no tensor changes layout here.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from .attention_switch import AttentionSwitch
from .buffered_cache import BufferedCache
from .lean_forward import LeanForward, lean_forward_of
from .row_major import RowMajorLinears

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelCall:
    """What the forwards of one assembler share: the model, its forward lock, the attention switch,
    the row-major linears and the lean forward."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        windows: Collection[int | None],
        transposed_batch_weights: bool,
        lean_forward: bool,
    ) -> None:
        self.model = model
        # Forward calls of concurrent requests take turns: the attention switch is shared
        # state of the model (also between engines that share it), and two calls at once would
        # only split the same cores.
        self.lock = model_lock(model)
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed ``past_key_values`` to ``cache``; accept either.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.attention = AttentionSwitch(model, windows)
        self.linears = RowMajorLinears(model, enabled=transposed_batch_weights)
        self.lean_wanted = lean_forward and LeanForward.supports(model) is None
        """Whether split-invariant forwards run the lean forward (else the model's modules)."""
        self._lean: LeanForward | None = None  # made at the first split-invariant forward (packs weights)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def inputs(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cache: Cache, **extra: Any
    ) -> dict[str, Any]:
        """The keyword arguments of a model call running ``token_ids`` at ``positions`` over ``cache``."""
        return {
            "input_ids": token_ids,
            "position_ids": positions,
            "use_cache": True,
            self._cache_kwarg: cache,
            **extra,
        }

    def lean_for(self, cache: Cache) -> LeanForward | None:
        """The lean forward for a call over ``cache`` (made at first use), or None."""
        if not self.lean_wanted or not isinstance(cache, BufferedCache):
            return None
        if self._lean is None:
            self._lean = lean_forward_of(self.model)
        return self._lean


_FORWARD_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.Lock:
    """One forward lock per model object, shared by every assembler of that model (kept beside the
    model, not on it, so the model can still be copied)."""
    with _LOCKS_GUARD:
        return _FORWARD_LOCKS.setdefault(model, threading.Lock())
