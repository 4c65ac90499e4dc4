"""The result of a finished request, alone or batched: its text, usage and timings in one
:class:`~kvboost_rag.results.GenerationResult`, built the same way for both paths."""

from __future__ import annotations

import torch

from .decoding import SpeculationStats
from .prepared import Prepared
from .results import FinishReason, GenerationResult, Timings, Usage
from .runner import PrefillOutcome


def build_result(
    prepared: Prepared,
    prefill: PrefillOutcome | None,
    *,
    text: str,
    token_ids: list[int],
    finish: FinishReason,
    recomputed_tokens: int,
    timings: Timings,
    first_logits: torch.Tensor,
    reuse_note: str | None,
    speculation: SpeculationStats | None = None,
) -> GenerationResult:
    """The result of a finished request; ``prefill`` is None for a batch row without a stored prefix."""
    cached = prefill.cached_by_tier if prefill is not None else {}
    usage = Usage(
        prompt_tokens=len(prepared.canonical),
        completion_tokens=len(token_ids),
        cached_tokens=sum(cached.values()),
        cached_tokens_by_tier=dict(cached),
        approx_tokens=prefill.approx_tokens if prefill is not None else 0,
        blended_tokens=prefill.blended_tokens if prefill is not None else 0,
        unused_prewarmed_tokens=prefill.unused_document_tokens if prefill is not None else 0,
        recomputed_tokens=recomputed_tokens,
        stored_tokens=prefill.stored_tokens if prefill is not None else 0,
        drafted_tokens=speculation.drafted_tokens if speculation is not None else 0,
        accepted_tokens=speculation.accepted_tokens if speculation is not None else 0,
    )
    logits = first_logits.clone() if prepared.request.return_logits else None
    return GenerationResult(text, token_ids, finish, usage, timings, logits, reuse_note)
