"""Decoding one request: its chosen tokens go in, the logits of the next come out.

With the split-invariant forward (``assembler.invariant``) every decode step runs as a prefill
does, padded to ``ROW_MULTIPLE`` rows, so a generated token's KV and logits are the bits a
prefill of the same tokens gives (DESIGN.md contract 2). Two things follow:

- the reply's KV is stored as it is, with no second pass (see ``Generation``);
- the pad rows can carry drafted tokens (:mod:`~kvboost_rag.drafting`) for the price of their
  attention (the matrix products run the pad rows anyway): row j of a verification gives the
  logits a step ending at draft j would give, bitwise. The request
  chooses each next token from those logits exactly as it would without speculation (greedy, or
  one seeded draw per position, in order), and a draft is used only while it equals the chosen
  token, so speculation never changes the output; it only saves forwards.

Without the split-invariant forward (the canonical schedule) decode steps run one row, as
transformers decodes, and nothing is drafted.

Cache layout while speculating: ``[ committed tokens | fed token, drafts (verified later) ]``;
:meth:`DecodeStepper.settle` drops the unconfirmed tail.

On models with sliding-window layers the stepper lets those layers drop the key blocks that no
later step attends (``BufferedCache.drop_behind``), so their memory stays about the window
however long the request; ``keep_from`` keeps the positions a caller still reads afterwards
(the reply, stored from the cache for the next turn).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .assembler import Assembler
from .assembler.buffered_cache import BufferedCache
from .block_attention import ROW_MULTIPLE
from .drafting import DraftBudget, NgramDrafter
from .request import Request
from .sampling import select_token


@dataclass
class SpeculationStats:
    """Drafted tokens of one request and how many of them the model confirmed."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forwards: int = 0
    """Decode forwards run (each gives one token, plus the confirmed drafts)."""


class DecodeStepper:
    """Feeds one request's chosen tokens through the model, drafting ahead where it can.

    ``cache`` holds ``position`` tokens (``history``: their ids). :meth:`next_logits` takes the
    token just chosen and returns float32 logits ``[vocab]`` for the next one; it runs a forward
    only when that token was not drafted and verified already. ``end``: the request's last
    position + 1 (prompt and ``max_new_tokens``); no draft is fed past what can still be chosen,
    so drafts never run past the cache's capacity or the model's positions. ``keep_from``: the
    first position the cache must still hold when decoding ends (None: only what later steps attend).
    """

    def __init__(
        self,
        assembler: Assembler,
        cache: Cache,
        history: Sequence[int],
        *,
        end: int,
        max_draft_tokens: int,
        keep_from: int | None = None,
    ) -> None:
        self._assembler, self._cache, self._end = assembler, cache, end
        self._keep_from = keep_from
        self.position = len(history)
        """Tokens whose KV the cache holds for sure (the prompt, then each token fed and confirmed)."""
        self.exact = assembler.invariant and isinstance(cache, BufferedCache)
        """Decode steps give the bits of a prefill (and may carry drafts)."""
        self._max_draft = max_draft_tokens if self.exact else 0
        self._drafter = NgramDrafter(history) if self._max_draft else None
        self._pending: list[int] = []  # drafted tokens fed after the last confirmed one
        self._pending_logits: torch.Tensor | None = None  # [len(pending), vocab]: after each draft
        self._budget = DraftBudget(self._max_draft, free_rows=ROW_MULTIPLE - 1)
        self._drafted = self._confirmed = 0  # of the last verification
        self.stats = SpeculationStats()

    def next_logits(self, token: int) -> torch.Tensor:
        """Logits for the token after ``token`` (the one just chosen), all previous ones included."""
        if self._pending and self._pending[0] == token:  # a confirmed draft: its logits are known
            assert self._pending_logits is not None
            logits = self._pending_logits[0]
            self._pending, self._pending_logits = self._pending[1:], self._pending_logits[1:]
            self.position += 1
            self.stats.accepted_tokens += 1
            self._confirmed += 1
            if self._drafter is not None:
                self._drafter.extend([token])
            return logits
        self.settle()  # the model chose otherwise (or nothing was drafted): drop the drafts' KV
        self._budget.record(drafted=self._drafted, accepted=self._confirmed)
        if self._drafter is not None:
            self._drafter.extend([token])
        drafts = self._drafter.draft(self._draft_room()) if self._drafter is not None else []
        self._drafted, self._confirmed = len(drafts), 0
        assembler, cache = self._assembler, self._cache
        rows = [token, *drafts]
        if self.exact:
            assert isinstance(cache, BufferedCache)  # exact steps run over buffered caches
            cache.drop_behind(self.position, self._keep_from)
            out = assembler.forward_tail(cache, rows, self.position, len(rows))
        else:
            out = assembler.forward_tail(cache, rows, self.position, 1, exact_rows=False)
        assert out is not None  # logits asked for
        self.stats.forwards += 1
        self.stats.drafted_tokens += len(drafts)
        self.position += 1
        self._pending, self._pending_logits = drafts, out[1:]
        return out[0]

    def settle(self) -> None:
        """Drop the KV of drafts not confirmed yet: the cache then holds exactly the fed tokens."""
        if self._pending:
            assert isinstance(self._cache, BufferedCache)  # drafts only over buffered caches
            self._cache.truncate(self.position)
            self._pending, self._pending_logits = [], None

    def _draft_room(self) -> int:
        """Drafts the budget allows, before the last position (whose token is chosen, never fed)."""
        return max(min(self._budget.room(), self._end - 2 - self.position), 0)


def decode(
    stepper: DecodeStepper,
    first_logits: torch.Tensor,
    request: Request,
    eos_ids: frozenset[int],
    max_new_tokens: int,
) -> Iterator[int]:
    """Yield sampled tokens until EOS (yielded too) or ``max_new_tokens``; the caller may stop early.

    Each token is chosen from its logits as the request's sampling says, one generator draw per
    token in order, whether or not it was drafted. The stepper holds only fed tokens afterwards.
    """
    generator = request.generator(first_logits.device)
    logits = first_logits
    try:
        for step in range(max_new_tokens):
            token = select_token(logits, request, generator)
            yield token
            if token in eos_ids or step == max_new_tokens - 1:
                return
            logits = stepper.next_logits(token)
    finally:
        stepper.settle()
