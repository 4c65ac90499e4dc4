"""Sampling parameters and next-token selection."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy.

    >>> SamplingParams(max_new_tokens=0)
    Traceback (most recent call last):
    ...
    kvboost_rag.errors.InvalidRequestError: max_new_tokens must be >= 1 (got 0); ask for at least one token
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            msg = f"max_new_tokens must be >= 1 (got {self.max_new_tokens!r}); ask for at least one token"
            raise InvalidRequestError(msg)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            msg = f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding"
            raise InvalidRequestError(msg)
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1] (got {self.top_p}); use 1.0 to disable it")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (got {self.top_k}); use 0 to disable it")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings (got {self.stop!r})")

    @staticmethod
    def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        return (stop,) if isinstance(stop, str) else tuple(stop)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        # An unseeded request draws its own seed; torch's global generator is left alone.
        gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return gen


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from float32 logits ``[vocab]``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the first one is always kept)
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
