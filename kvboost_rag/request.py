"""One generation request: the prompt and every setting of how to answer it.

The engine, both framework adapters and the server protocol all build a :class:`Request`,
so each setting is named, defaulted and checked here only.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .canonical import PromptInput
from .config import ReuseMode
from .errors import InvalidRequestError

REUSE_MODES: tuple[ReuseMode, ...] = ("exact", "blend", "off")

SEED_RANGE = range(-(2**63), 2**64)
"""Seeds a torch generator takes."""


@dataclass(frozen=True)
class Request:
    """One generation request. ``temperature == 0`` is greedy.

    The fields after ``prompt`` are the keyword arguments of :meth:`KVBoostEngine.generate`.
    Bad settings raise :class:`~kvboost_rag.errors.InvalidRequestError` here, before any work:

    >>> Request("Hi", stop="END").stop
    ('END',)
    >>> Request("Hi", max_new_tokens=0)
    Traceback (most recent call last):
    ...
    kvboost_rag.errors.InvalidRequestError: max_new_tokens must be >= 1 (got 0); ask for at least one token
    """

    prompt: PromptInput
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | Sequence[str] | None = ()
    """Stop strings (trimmed from the output); stored as a tuple."""
    return_logits: bool = False
    """Keep the float32 logits of the first generated position in the result."""
    add_generation_prompt: bool = True
    reuse: ReuseMode | None = None
    """Overrides the engine's reuse mode: ``"off"`` runs the uncached path, ``"blend"`` also reuses
    pre-warmed documents at new positions (approximate; counted in ``usage.approx_tokens``)."""
    blend_recompute_ratio: float | None = None
    """Blend mode: share of reused document tokens recomputed (None: the engine's setting)."""
    cache_salt: str | None = None
    """Tenant of the KV this request reads and writes: requests with different salts (or one with
    a salt and one without) never share stored KV, nor can they tell by timing what the other
    stored. None: the shared store."""

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            msg = f"max_new_tokens must be >= 1 (got {self.max_new_tokens!r}); ask for at least one token"
            raise InvalidRequestError(msg)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            msg = f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding"
            raise InvalidRequestError(msg)
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1] (got {self.top_p}); use 1.0 to disable it")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (got {self.top_k}); use 0 to disable it")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed not in SEED_RANGE):
            msg = f"seed must be an integer in [-2**63, 2**64) (got {self.seed!r}); pick a smaller seed"
            raise InvalidRequestError(msg)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings (got {stop!r})")
        if self.reuse is not None and self.reuse not in REUSE_MODES:
            msg = f"reuse={self.reuse!r} is not a reuse mode; use 'exact', 'blend' or 'off'"
            raise InvalidRequestError(msg)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty string (got {self.cache_salt!r}); or None"
            )
        ratio = self.blend_recompute_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise InvalidRequestError(
                f"blend_recompute_ratio={ratio} is outside 0..1; pass a share such as 0.05"
            )

    @classmethod
    def of(cls, prompt: PromptInput, settings: Mapping[str, Any]) -> Request:
        """A request from a prompt and settings by name, naming any unknown setting in the error.

        >>> Request.of("Hi", {"temprature": 0.5})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kvboost_rag.errors.InvalidRequestError: unknown setting 'temprature'; known: max_new_tokens, ...
        """
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            known = ", ".join(SETTINGS)
            raise InvalidRequestError(f"unknown setting {', '.join(map(repr, unknown))}; known: {known}")
        return cls(prompt, **settings)

    @classmethod
    def coerce(cls, prompt: PromptInput | Request, settings: Mapping[str, Any]) -> Request:
        """A request from a prompt and settings, or a given request with ``settings`` changed."""
        if isinstance(prompt, Request):
            return prompt.with_settings(**settings) if settings else prompt
        return cls.of(prompt, settings)

    def with_settings(self, **changes: Any) -> Request:
        """A copy with some settings changed (checked again)."""
        return Request.of(self.prompt, {name: getattr(self, name) for name in SETTINGS} | changes)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as the tuple it is stored as."""
        return self.stop  # type: ignore[return-value]

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The random generator of a sampled request (None when greedy)."""
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        # An unseeded request draws its own seed; torch's global generator is left alone.
        gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return gen


SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Request) if f.name != "prompt")
"""The names of a request's settings, in order."""
