"""What the engine returns: results of a generation, stream deltas, and warm-up reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

FinishReason = Literal["stop", "length"]


@dataclass
class Usage:
    """Token accounting of one request (DESIGN.md contract 6).

    >>> Usage(prompt_tokens=120, completion_tokens=8, cached_tokens=96).total_tokens
    128
    """

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens read exactly: from the store, all tiers, and from a held context."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """``cached_tokens`` by where they came from: a store tier (``"memory"``, ``"disk"``, ``"redis"``)
    or ``"context"``, the held cache of an earlier request (:attr:`EngineConfig.held_context_tokens`)."""
    approx_tokens: int = 0
    """Prompt tokens reused approximately (blend mode); 0 in exact mode."""
    blended_tokens: int = 0
    """Blend mode: prompt tokens whose stored KV was found and laid at their new position; the
    ``approx_tokens`` of them kept it, the rest (each document's first tokens, the most deviating
    share) were recomputed over it."""
    unused_prewarmed_tokens: int = 0
    """About how many prompt tokens lie in pre-warmed documents yet were computed again instead of
    read: exact mode reads a document only right after the text it was pre-warmed after (blend
    reads it anywhere), and a document whose KV was evicted is computed again in either mode."""
    recomputed_tokens: int = 0
    """Prompt tokens run through the model."""
    stored_tokens: int = 0
    """Prompt tokens newly written to the store."""
    drafted_tokens: int = 0
    """Tokens drafted by prompt lookup and checked by the model (speculative decoding)."""
    accepted_tokens: int = 0
    """Drafted tokens the model confirmed: each saved a decode forward. The output is the same
    with speculation on or off."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """Where a request's time went, in seconds."""

    ttft_s: float
    """From the call to the first generated token: tokenization, lookup, loading and prefill included."""
    total_s: float
    prefill_s: float
    select_s: float = 0.0
    """Blend mode: time spent choosing the reused tokens to recompute (part of ``prefill_s``)."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    """Generated ids (EOS included when generation ended on it)."""
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    first_logits: torch.Tensor | None = None
    """float32 logits of the first generated position, when ``return_logits=True``."""
    reuse_note: str | None = None
    """Why chunk reuse was not used for this request, when it was not."""

    def reuse_report(self) -> dict[str, Any]:
        """Reuse and timing details as plain data, for framework response metadata."""
        u, t = self.usage, self.timings
        return {
            "cached_tokens": u.cached_tokens,
            "cached_tokens_by_tier": dict(u.cached_tokens_by_tier),
            "approx_tokens": u.approx_tokens,
            "blended_tokens": u.blended_tokens,
            "unused_prewarmed_tokens": u.unused_prewarmed_tokens,
            "recomputed_tokens": u.recomputed_tokens,
            "stored_tokens": u.stored_tokens,
            "drafted_tokens": u.drafted_tokens,
            "accepted_tokens": u.accepted_tokens,
            "ttft_s": t.ttft_s,
            "blend_select_s": t.select_s,
            "total_s": t.total_s,
            "reuse_note": self.reuse_note,
        }


class StreamChunk(NamedTuple):
    """One streaming step: a text delta; the last one also carries the full result."""

    text: str
    result: GenerationResult | None = None


@dataclass
class WarmReport:
    """What :meth:`KVBoostEngine.warm` did."""

    prompt_tokens: int
    cached_tokens: int
    stored_tokens: int
    seconds: float


@dataclass
class PrewarmReport:
    """What :meth:`KVBoostEngine.prewarm` did."""

    documents: int
    skipped: int
    """Documents whose every chunk was already stored (a resumed run skips them)."""
    tokens: int
    """Prompt tokens (prefix + document) over all documents processed."""
    computed_tokens: int
    seconds: float
    keys: list[str] = field(default_factory=list)
    """Prefix key of each pre-warmed document's last chunk, in input order (empty documents have none).
    The key names the exact ``prefix + document`` KV: ``engine.store.contains(key)`` tells whether
    it is stored."""

    @property
    def tokens_per_s(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0
