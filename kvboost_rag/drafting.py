"""Drafts for speculative decoding, looked up in the request's own tokens (prompt lookup).

Answers quote their context: a RAG answer copies phrases of the retrieved passages, a chat
reply repeats names and code from the history, an agent repeats tool output. When the last
few tokens of the sequence so far (the prompt and the reply) occurred before, the tokens that
followed them then are a good guess of what follows now. The model verifies such a draft in one
forward (:class:`~kvboost_rag.decoding.DecodeStepper`); a wrong guess costs nothing but the rows
it rode in.

>>> drafter = NgramDrafter([5, 6, 7, 8, 9, 5, 6], max_ngram=3)
>>> drafter.draft(3)  # ... 5 6 | 7 8 9 followed "5 6" before
[7, 8, 9]
>>> drafter.extend([7, 1]); drafter.draft(3)  # "7 1" never occurred; "1" neither
[]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

MAX_NGRAM = 3
"""Longest suffix looked up; shorter ones are tried when it has no earlier occurrence."""

WIDE_AFTER = 2
"""Verifications confirmed whole in a row after which drafts may pass the free rows."""
MISSES_BEFORE_PAUSE = 3
"""Verifications in a row with no draft confirmed, after which drafting pauses."""
PAUSE_STEPS = (2, 16)
"""The first pause, in decode steps, and the longest: each pause that follows a pause doubles."""


class NgramDrafter:
    """Proposes the continuation of the latest earlier occurrence of the sequence's last n tokens
    (n from ``max_ngram`` down to 1)."""

    def __init__(self, token_ids: Sequence[int], *, max_ngram: int = MAX_NGRAM) -> None:
        self._max_ngram = max_ngram
        self._ids = np.empty(max(2 * len(token_ids), 64), dtype=np.int64)
        self._length = 0
        self.extend(token_ids)

    def __len__(self) -> int:
        return self._length

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens to the sequence (the reply as it is decided)."""
        new = np.fromiter(token_ids, dtype=np.int64)
        end = self._length + len(new)
        if end > len(self._ids):
            grown = np.empty(max(end, 2 * len(self._ids)), dtype=np.int64)
            grown[: self._length] = self._ids[: self._length]
            self._ids = grown
        self._ids[self._length : end] = new
        self._length = end

    def draft(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest
        suffix found (empty when none)."""
        ids, length = self._ids[: self._length], self._length
        if max_tokens <= 0:
            return []
        for n in range(min(self._max_ngram, length - 1), 0, -1):
            suffix = ids[length - n :]
            # starts of earlier occurrences: windows over ids[:-1], so a match has a token after it
            windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n
                return ids[follow : follow + max_tokens].tolist()
        return []


class DraftBudget:
    """How many tokens to draft next, from how the last drafts fared.

    Drafts up to ``free_rows`` ride in rows a step runs anyway; their attention still costs a
    little, so drafting pauses after ``MISSES_BEFORE_PAUSE`` verifications in a row confirmed
    nothing (text that quotes nothing), for longer each time. After ``WIDE_AFTER`` verifications
    confirmed whole (a long quote), up to ``max_tokens`` are drafted.

    >>> budget = DraftBudget(15, free_rows=7)
    >>> budget.room()
    7
    >>> for _ in range(3): budget.record(drafted=7, accepted=0)
    >>> budget.room(), budget.room()  # paused for two steps
    (0, 0)
    >>> budget.record(drafted=0, accepted=0); budget.record(drafted=0, accepted=0); budget.room()
    7
    >>> budget.record(drafted=7, accepted=7); budget.record(drafted=7, accepted=7); budget.room()
    15
    """

    def __init__(self, max_tokens: int, *, free_rows: int) -> None:
        self._max, self._free = max_tokens, min(max_tokens, free_rows)
        self._whole = self._misses = self._paused = 0
        self._next_pause = PAUSE_STEPS[0]

    def room(self) -> int:
        """Tokens to draft for the next step."""
        if self._paused:
            return 0
        return self._max if self._whole >= WIDE_AFTER else self._free

    def record(self, *, drafted: int, accepted: int) -> None:
        """How the last step's drafts fared (``drafted=0``: the step drafted nothing)."""
        if not drafted:
            self._paused = max(self._paused - 1, 0)
            return
        self._whole = self._whole + 1 if accepted == drafted else 0
        if accepted:
            self._misses, self._next_pause = 0, PAUSE_STEPS[0]
            return
        self._misses += 1
        if self._misses >= MISSES_BEFORE_PAUSE:
            self._paused, self._misses = self._next_pause, 0
            self._next_pause = min(2 * self._next_pause, PAUSE_STEPS[1])
