"""The batch driver: requests decoding together on one :class:`~kvboost_rag.batch.RunningBatch`,
joined by others between its steps, each one's result handed to its caller as it leaves.

Which requests may share a batch is :func:`can_batch`; how a request's prompt becomes a
batch row (its prefill) is the lone-request driver's choice (:class:`~kvboost_rag.generation.Generation`),
handed in as two callables.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from functools import partial
from typing import cast

from .batch import BatchRow, RowOutput, RunningBatch
from .core import EngineCore
from .keys import Chunk
from .next_turn import NextTurn
from .prepared import Hooks, OnDelta, Outcome, Prepared
from .result_builder import build_result
from .results import FinishReason, GenerationResult, Timings
from .runner import PrefillOutcome

PrefillAlone = Callable[[Prepared, threading.Event | None], PrefillOutcome]
"""The whole prompt's cache, prefilled as a lone request's is (``cancel`` stops it)."""

MakeRow = Callable[[Prepared, list[Chunk], threading.Event | None, OnDelta | None], BatchRow]
"""A request as a batch row, from its chunks, ``cancel`` and ``on_delta``."""


def can_batch(prepared: Prepared, blocker: Callable[[int], str | None]) -> bool:
    """Whether a request may share a batch: not blend mode, and nothing in the assembler's way
    (``blocker``: why a row of that many tokens cannot be batched, e.g. past a sliding window)."""
    return prepared.mode != "blend" and blocker(len(prepared.canonical) + prepared.max_new_tokens) is None


class DecodingBatch:
    """Requests decoding together on one :class:`~kvboost_rag.batch.RunningBatch`; others join it
    between its steps (:meth:`admit`), and each one's ``on_outcome`` hook hears of it as it leaves.

    A joining request must be able to run in a batch (:meth:`admit` hands back the others). The
    prefix that the rows share is kept once for all rows (a batch that started with a lone request
    takes it out of that request's cache when the first rows join) until a request without it
    joins; from then on each row holds its own copy.
    """

    def __init__(
        self, core: EngineCore, next_turn: NextTurn, *, prefill_alone: PrefillAlone, make_row: MakeRow
    ) -> None:
        self._core = core
        self._next_turn = next_turn
        self._prefill_alone = prefill_alone
        self._make_row = make_row
        self._running: RunningBatch | None = None
        self._shared_keys: list[str] = []
        """Keys of the leading chunks that the running rows share (kept once)."""
        self._lone_keys: list[tuple[str, int]] = []
        """(key, end) of the lone adopted row's chunks: those that joiners share become the batch's
        shared prefix."""

    def __len__(self) -> int:
        return len(self._running) if self._running is not None else 0

    def start_lone(self, prepared: Prepared, hooks: Hooks) -> None:
        """Start with one request, prefilled and decoded as a lone request is (bitwise the same
        tokens, logits and stored chunks) until others join it."""
        core = self._core
        t_prefill = time.perf_counter()
        try:
            with core.lock:
                out = self._prefill_alone(prepared, hooks.cancel)
        except Exception as e:
            self._settle(prepared, hooks, e)
            return
        row = BatchRow(
            prepared.canonical.token_ids,
            out,
            len(prepared.canonical),
            prepared.request,
            prepared.max_new_tokens,
            hooks.cancel,
            hooks.on_delta,
        )
        row.on_finish = partial(self._finish, prepared, hooks, row, t_prefill)
        self._running = RunningBatch(
            core.assembler,
            core.tokenizer,
            core.eos_ids,
            core.lock,
            max_draft_tokens=core.config.max_draft_tokens,
        )
        stores_reply = self._next_turn.stores_reply(prepared)
        self._running.adopt(row, keep_from=len(prepared.canonical) if stores_reply else None)
        chunks = core.chunks(prepared.canonical, prepared.request.cache_salt)
        self._lone_keys = [(c.key, c.end) for c in chunks]

    def admit(self, items: Sequence[tuple[Prepared, Hooks]]) -> list[Prepared]:
        """Prefill these requests' prefixes through the store and their last chunks as one batch; they
        decode with the running rows from the next step. Returns the requests that cannot join."""
        core = self._core
        blocker = core.assembler.batch_blocker
        refused: list[Prepared] = []
        rows: list[BatchRow] = []
        admitted: list[tuple[Prepared, Hooks]] = []  # of each row
        keys: list[list[tuple[str, int]]] = []  # (key, end) of each row's prefix chunks
        t_admit = time.perf_counter()
        with core.lock:
            for prepared, hooks in items:
                if not can_batch(prepared, blocker):
                    refused.append(prepared)
                    continue
                chunks = core.chunks(prepared.canonical, prepared.request.cache_salt)
                prefix_keys = [c.key for c in chunks[:-1]]  # the last chunk is prefilled per row
                if prefix_keys[: len(self._shared_keys)] != self._shared_keys:
                    assert self._running is not None  # only a running batch shares keys
                    self._running.unshare()  # this row lacks the shared prefix: rows hold their own
                    self._shared_keys = []
                try:
                    row = self._make_row(prepared, chunks, hooks.cancel, hooks.on_delta)
                except Exception as e:  # this request alone fails; the others still run
                    self._settle(prepared, hooks, e)
                    continue
                row.on_finish = partial(self._finish, prepared, hooks, row, t_admit)
                rows.append(row)
                admitted.append((prepared, hooks))
                keys.append([(c.key, c.end) for c in chunks[:-1]])
        if not rows:
            return refused
        if self._running is None or self._running.lone:
            lone = [self._lone_keys] if self._running is not None else []
            shared = _common_prefix_tokens(lone + keys)
            if self._running is None:
                self._running = RunningBatch(core.assembler, core.tokenizer, core.eos_ids, core.lock, shared)
            else:  # the lone row's copy of the prefix becomes the batch's one
                self._running.share(shared)
            held = self._running.shared_tokens
            self._shared_keys = [key for key, end in keys[0] if end <= held]
        try:
            self._running.admit(rows)
        except Exception as e:  # e.g. out of memory: these requests fail, the running ones go on
            for prepared, hooks in admitted:
                self._settle(prepared, hooks, e)
        return refused

    def step(self) -> bool:
        """One decode step of every running row; False once none is left."""
        return self._running is not None and self._running.step()

    def _finish(
        self, prepared: Prepared, hooks: Hooks, row: BatchRow, t_prefill: float, out: RowOutput
    ) -> None:
        """A row left the batch: its result (or what stopped it) goes to its caller now."""
        outcome = self._row_result(prepared, row, out, t_prefill)
        reply_stored = (
            isinstance(outcome, GenerationResult)
            and out.exact_cache is not None
            and self._next_turn.store_reply_now(prepared, outcome.text, out.exact_cache, out.cache_ids)
        )
        if isinstance(outcome, GenerationResult) and out.exact_cache is not None:
            self._next_turn.hold(prepared, row.prefix, out.exact_cache, out.cache_ids)
        self._settle(prepared, hooks, outcome, reply_stored=reply_stored)

    def _settle(
        self, prepared: Prepared, hooks: Hooks, outcome: Outcome, *, reply_stored: bool = False
    ) -> None:
        if isinstance(outcome, GenerationResult) and not reply_stored:  # before the caller's next turn
            self._next_turn.follow_up(prepared, outcome)
        if hooks.on_outcome is not None:
            hooks.on_outcome(outcome)

    def _row_result(self, p: Prepared, row: BatchRow, out: RowOutput, t_prefill: float) -> Outcome:
        """The result of a finished batch row (or what stopped it)."""
        if out.finish_reason == "cancelled" or out.error is not None:
            return out.error or CancelledError()
        done = time.perf_counter()
        prefix_recomputed = row.prefix.recomputed_tokens if row.prefix else 0
        recomputed = prefix_recomputed + len(p.canonical) - row.prefix_tokens
        timings = Timings(
            out.first_token_at - p.submitted_at, done - p.submitted_at, out.first_token_at - t_prefill
        )
        finish = cast(FinishReason, out.finish_reason)  # "cancelled" and "error" are left above
        return build_result(
            p,
            row.prefix,
            text=out.text,
            token_ids=out.token_ids,
            finish=finish,
            recomputed_tokens=recomputed,
            timings=timings,
            first_logits=out.first_logits,
            reuse_note=self._core.reuse_note if p.mode == "exact" else None,
            speculation=out.speculation,
        )


def _common_prefix_tokens(keys: Sequence[Sequence[tuple[str, int]]]) -> int:
    """Tokens of the leading chunks that every row has, from each row's chunk ``(key, end)`` list
    (the same keys: the same KV)."""
    shared = 0
    for column in zip(*keys, strict=False):  # up to the shortest list
        if any(entry != column[0] for entry in column):
            break
        shared = column[0][1]
    return shared
