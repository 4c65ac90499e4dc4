"""Generation: one request alone (the exact path, streamed token by token), or many as one batch.

A request is first *prepared* (checked, canonicalized, fitted to the context window),
so bad input fails before any work and alone. Prepared requests then run alone when
they are alone or cannot share a batch (blend mode, sliding windows), else together
(:class:`DecodingBatch`), and requests that arrive meanwhile join the batch between its
decode steps. Either way the result is built by :func:`_result`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from functools import partial
from typing import Any, NamedTuple, cast

import torch
from transformers.cache_utils import Cache

from .assembler.buffered_cache import BufferedCache
from .async_stream import END, Delivery
from .batch import BatchRow, RowOutput, RunningBatch
from .blend import blend_prefill
from .canonical import CanonicalPrompt, is_messages
from .config import EngineConfig, ReuseMode
from .core import EngineCore
from .decoding import DecodeStepper, SpeculationStats, decode
from .followups import FollowUps
from .keys import Chunk, salted
from .request import Request
from .results import FinishReason, GenerationResult, StreamChunk, Timings, Usage
from .runner import PrefillOutcome, holding_writes
from .scheduler import Arrivals, BatchFuture, Pending
from .textstream import TextStream
from .unused_documents import UnusedDocuments, unused_document_tokens
from .warming import store_reply, store_reply_from_cache

logger = logging.getLogger(__name__)


OnDelta = Callable[[str], None]
"""Takes each piece of a request's new text, on the thread that generates it."""

Outcome = GenerationResult | BaseException


class Hooks(NamedTuple):
    """How a running request talks to its caller (each on the thread that generates it)."""

    cancel: threading.Event | None = None
    """Set by the caller: the request stops at its next layer or token."""
    on_delta: OnDelta | None = None
    """Each piece of new text as the request's tokens come out (streams)."""
    on_outcome: Callable[[Outcome], None] | None = None
    """The request's result (or error) as soon as it is known, before the rest of its batch ends."""


class Prepared(NamedTuple):
    """A request checked and canonicalized, ready to run."""

    request: Request
    canonical: CanonicalPrompt
    mode: ReuseMode
    max_new_tokens: int
    """The request's, capped by what the context window leaves."""
    submitted_at: float
    """``time.perf_counter()`` when the request came in (timings count from it)."""


class CancellableStream(Iterator[StreamChunk]):
    """Text deltas of one request, then a last item that carries its result (see
    :meth:`KVBoostEngine.stream`).

    :meth:`cancel`, from any thread, stops the request at its next layer or token, in a long
    prefill too; the stream then raises ``concurrent.futures.CancelledError``.
    """

    def __init__(self, generation: Generation, prepared: Prepared) -> None:
        self._cancel = threading.Event()
        self._steps = generation.stream(prepared, self._cancel)

    def __next__(self) -> StreamChunk:
        return next(self._steps)

    def cancel(self) -> None:
        """Stop the request at its next layer or token (safe from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancel.is_set()

    def close(self) -> None:
        """End the stream here (from the thread that iterates it), releasing what it holds."""
        self._steps.close()


class ScheduledStream(Iterator[StreamChunk]):
    """Text deltas of one request served by the batching scheduler, then a last item that carries
    its result (see :meth:`KVBoostEngine.stream`).

    The request shares every decode step with the other requests running beside it; its items
    are queued as its tokens come out (:class:`~kvboost_rag.async_stream.Delivery`), so a slow
    reader never holds the batch back, and one that falls more than ``max_buffered`` deltas
    behind gets :class:`~kvboost_rag.errors.StreamOverflowError`. :meth:`cancel`, from any
    thread, stops the request at its next layer or token; the stream then raises ``CancelledError``.
    """

    def __init__(
        self, submit: Callable[[Prepared, OnDelta], BatchFuture], prepared: Prepared, max_buffered: int
    ) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._delivery = Delivery(self._items.put, self._items.qsize, max_buffered)
        self._delivery.begin(partial(submit, prepared))
        self._done = False

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        item = self._items.get()
        if item is END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        chunk: StreamChunk = item
        self._done = chunk.result is not None
        return chunk

    def cancel(self) -> None:
        """Stop the request at its next layer or token (safe from any thread; no effect once it ended)."""
        self._delivery.stop()

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called (or the reader fell too far behind)."""
        return self._delivery.stopped

    def close(self) -> None:
        """End the stream here; a request still running stops at its next layer or token."""
        if not self._done:
            self._done = True
            self.cancel()


class Generation:
    """Runs prepared requests on an :class:`~kvboost_rag.core.EngineCore`.

    Chat answers in exact mode are followed by storing the reply as the next turn
    renders it (``EngineConfig.store_replies``), queued on ``followups``.
    """

    def __init__(self, core: EngineCore, followups: FollowUps) -> None:
        self.core = core
        self.followups = followups
        self.unused = UnusedDocuments()

    def prepare(self, request: Request, submitted_at: float) -> Prepared:
        """Canonicalize a request and fit it to the context window (bad input raises here, before work)."""
        core = self.core
        mode = request.reuse or core.config.reuse
        if mode == "blend":
            core.blend_shifter()
        canonical = core.canonicalize(request.prompt, add_generation_prompt=request.add_generation_prompt)
        core.check_window(len(canonical), 1)
        max_new = core.room_for(len(canonical), request.max_new_tokens)
        return Prepared(request, canonical, mode, max_new, submitted_at)

    def serve(
        self, pending: Sequence[Pending[Request | Prepared]], arrivals: Arrivals[Request | Prepared]
    ) -> None:
        """Scheduler callback: prepare each request (streams come prepared), isolating bad input, and
        run them together; between decode steps, requests from ``arrivals`` join. Every request's
        future is settled as it ends; a stream's ``on_delta`` gets its text as its tokens come out.

        A request cancelled (or timed out) while it is prepared runs no further.
        """
        with self.followups.activity():
            batch = self._open(self._ready(pending))
            while batch is not None and batch.step():
                joining = arrivals.take(self.core.config.max_batch_size - len(batch))
                if joining:
                    refused = {id(prepared) for prepared in batch.admit(self._ready(joining))}
                    arrivals.hand_back([p for p in joining if id(p.request) in refused])

    def _ready(self, pending: Sequence[Pending[Request | Prepared]]) -> list[tuple[Prepared, Hooks]]:
        """Prepare scheduled requests; those that fail or were cancelled meanwhile are settled here.

        Each pending request keeps its prepared form (a request handed back is not prepared again).
        """
        ready = []
        for p in pending:
            try:
                item = p.request
                prepared = item if isinstance(item, Prepared) else self.prepare(item, p.submitted_at)
            except Exception as e:
                p.future.settle(e)
                continue
            if p.future.cancel_requested.is_set():
                p.future.settle(CancelledError())
                continue
            p.request = prepared
            ready.append((prepared, Hooks(p.future.cancel_requested, p.on_delta, p.future.settle)))
        return ready

    def run_all(
        self, prepared: list[Prepared], hooks: Sequence[Hooks] | None = None
    ) -> list[GenerationResult | BaseException]:
        """Run prepared requests to their ends: alone when there is one (the exact solo path), else as
        a batch; outcomes come back in order."""
        outcomes: list[Outcome | None] = [None] * len(prepared)
        given = list(hooks) if hooks is not None else [Hooks()] * len(prepared)

        def record(i: int, outcome: Outcome) -> None:
            outcomes[i] = outcome
            on_outcome = given[i].on_outcome
            if on_outcome is not None:
                on_outcome(outcome)

        items = [
            (p, h._replace(on_outcome=partial(record, i)))
            for i, (p, h) in enumerate(zip(prepared, given, strict=True))
        ]
        with self.followups.activity():
            batch = self._open(items)
            while batch is not None and batch.step():
                pass
        return outcomes  # type: ignore[return-value]

    def _open(self, items: list[tuple[Prepared, Hooks]]) -> DecodingBatch | None:
        """Run the requests that must run alone (blend mode, past a sliding window), each to
        its end; start the others as a batch that later requests can join (None when there is none)."""
        blocker = self.core.assembler.batch_blocker
        together = []
        for prepared, hooks in items:
            if self._can_batch(prepared, blocker):
                together.append((prepared, hooks))
            else:
                self._solo_outcome(prepared, hooks)
        if not together:
            return None
        batch = DecodingBatch(self)
        if len(together) == 1:
            batch.start_lone(*together[0])  # the exact single-request path, until others join
        else:
            batch.admit(together)
        return batch if len(batch) else None

    @staticmethod
    def _can_batch(prepared: Prepared, blocker: Callable[[int], str | None]) -> bool:
        return prepared.mode != "blend" and blocker(len(prepared.canonical) + prepared.max_new_tokens) is None

    def _solo_outcome(self, prepared: Prepared, hooks: Hooks) -> None:
        outcome: Outcome
        try:
            outcome = self.solo(prepared, hooks.cancel, hooks.on_delta)
        except Exception as e:
            outcome = e
        if hooks.on_outcome is not None:
            hooks.on_outcome(outcome)

    def solo(
        self, prepared: Prepared, cancel: threading.Event | None = None, on_delta: OnDelta | None = None
    ) -> GenerationResult:
        """Run one request alone to its result; ``cancel`` stops it at its next layer or token."""
        result = None
        for chunk in self.stream(prepared, cancel):
            if on_delta is not None and chunk.text:
                on_delta(chunk.text)
            result = chunk.result
        assert result is not None
        return result

    def stream(
        self, prepared: Prepared, cancel: threading.Event | None = None
    ) -> Generator[StreamChunk, None, None]:
        """One request alone: text deltas, then the result; background work waits until it is done.

        Once ``cancel`` is set, the stream raises ``CancelledError`` at its next layer (in the
        prefill) or token.
        """
        with self.followups.activity():
            last, reply_stored = yield from self._steps(prepared, cancel)
        assert last.result is not None
        if not reply_stored:
            self._follow_up(prepared, last.result)
        yield last

    @staticmethod
    def _stores_reply(prepared: Prepared, config: EngineConfig) -> bool:
        """Whether the request's reply is stored for the next turn (see ``EngineConfig.store_replies``)."""
        request = prepared.request
        return (
            prepared.mode == "exact"
            and config.store_replies
            and is_messages(request.prompt)
            and request.add_generation_prompt
        )

    def _store_reply_now(self, prepared: Prepared, text: str, cache: Cache, cache_ids: Sequence[int]) -> bool:
        """Store the reply's chunks from the request's own ``cache`` (KV with a prefill's bits for
        ``cache_ids``), before the answer returns, so a call that follows at once reads them; True
        when that stored the whole reply (no background re-prefill needed)."""
        if not self._stores_reply(prepared, self.core.config):
            return True  # nothing to store
        messages = cast("Sequence[Mapping[str, Any]]", prepared.request.prompt)
        salt = prepared.request.cache_salt
        return store_reply_from_cache(self.core, messages, text, salt, cache, cache_ids)

    def _hold(
        self, prepared: Prepared, prefill: PrefillOutcome | None, cache: Cache, cache_ids: Sequence[int]
    ) -> None:
        """Keep an exact request's ``cache`` (KV with a prefill's bits for ``cache_ids``) for a request
        that continues it (:mod:`.held_context`); KV from a lossy store codec is never held."""
        if prepared.mode != "exact" or prefill is None or prefill.approx_tokens:
            return
        if isinstance(cache, BufferedCache):
            namespace = salted(self.core.namespace, prepared.request.cache_salt)
            self.core.held.keep(namespace, cache_ids, cache)

    def _follow_up(self, prepared: Prepared, result: GenerationResult) -> None:
        """Queue storing a chat reply as the next turn will render it, by a re-prefill once the
        engine is idle (see ``EngineConfig.store_replies``): for replies whose KV does not have a
        prefill's bits (batched rows, the canonical schedule), or that the template renders otherwise
        than the tokens generated."""
        if not self._stores_reply(prepared, self.core.config):
            return
        messages = prepared.request.prompt
        salt = prepared.request.cache_salt  # the reply is the tenant's too
        self.followups.submit(lambda: store_reply(self.core, messages, result.text, salt))  # type: ignore[arg-type]

    def _batch_row(
        self,
        p: Prepared,
        chunks: list[Chunk],
        cancel: threading.Event | None,
        on_delta: OnDelta | None = None,
    ) -> BatchRow:
        """A request as a batch row.

        When every chunk but the last is stored (or there is none), they are laid from the store and
        the last chunk runs with the other rows' last chunks, one forward for all. When some must be
        computed, the whole prompt is prefilled as a lone request's is: one forward instead of that
        one and the batched one, with the lone request's bits (and the same chunks stored).
        """
        core, ids = self.core, p.canonical.token_ids
        store = core.store if p.mode == "exact" else None
        row = partial(BatchRow, ids, request=p.request, max_new_tokens=p.max_new_tokens, cancelled=cancel)
        prefix_stored = store is not None and all(store.contains(c.key) for c in chunks[:-1])
        if len(chunks) > 1 and not prefix_stored:
            whole = self._prefill(p, True, p.mode != "off", cancel)
            return row(whole, len(ids), on_delta=on_delta)
        prefix = None
        if len(chunks) > 1:
            prefix = core.prefill(
                ids, chunks[:-1], store=store, capacity=chunks[-1].start, need_logits=False, stop=cancel
            )
        return row(prefix, chunks[-1].start, on_delta=on_delta)

    def _steps(
        self, prepared: Prepared, cancel: threading.Event | None
    ) -> Generator[StreamChunk, None, tuple[StreamChunk, bool]]:
        """Prefill and decode one request, yielding text deltas; returns the last delta with the result,
        and whether the reply was stored for the next turn already."""
        core = self.core
        request, canonical, mode, max_new = (
            prepared.request,
            prepared.canonical,
            prepared.mode,
            prepared.max_new_tokens,
        )
        n_prompt = len(canonical)
        blocker = core.assembler.exact_reuse_blocker(n_prompt + max_new)
        reuse = mode != "off" and blocker is None
        if blocker is not None:
            logger.info("chunk reuse off for this request: %s", blocker)
        # The lock covers the prefill only: decoding yields to the caller, and a stream that is
        # abandoned half-way must not keep other requests out (forward calls lock on their own).
        with core.lock:
            t_prefill = time.perf_counter()
            out = self._prefill(prepared, blocker is None, reuse, cancel)
            prefill_s = time.perf_counter() - t_prefill
        assert out.logits is not None
        text = TextStream(core.tokenizer, request.stop_strings)
        first_token_at = None
        finish: FinishReason = "length"
        stepper = DecodeStepper(
            core.assembler,
            out.cache,
            canonical.token_ids,
            end=n_prompt + max_new,
            max_draft_tokens=core.config.max_draft_tokens,
            keep_from=n_prompt if self._stores_reply(prepared, core.config) else None,
        )
        for token in decode(stepper, out.logits, request, core.eos_ids, max_new):
            if cancel is not None and cancel.is_set():
                raise CancelledError()
            first_token_at = first_token_at or time.perf_counter()
            delta = text.push(token)
            if delta:  # also the text that a stop string's token makes safe
                yield StreamChunk(delta)
            if token in core.eos_ids or text.stopped:
                finish = "stop"
                break
        stepper.settle()
        tail = text.finish()
        cache_ids = [*canonical.token_ids, *text.ids[: stepper.position - n_prompt]]
        reply_stored = stepper.exact and self._store_reply_now(prepared, text.text, out.cache, cache_ids)
        if stepper.exact:
            self._hold(prepared, out, out.cache, cache_ids)
        t0 = prepared.submitted_at
        ttft = (first_token_at - t0) if first_token_at else 0.0
        timings = Timings(ttft, time.perf_counter() - t0, prefill_s, out.select_s)
        note = blocker or (core.reuse_note if reuse else None)
        result = _result(
            prepared,
            out,
            text.text,
            list(text.ids),
            finish,
            out.recomputed_tokens,
            timings,
            out.logits,
            note,
            stepper.stats,
        )
        return StreamChunk(tail, result), reply_stored

    def _prefill(
        self, prepared: Prepared, chunked: bool, reuse: bool, cancel: threading.Event | None
    ) -> PrefillOutcome:
        """The prompt's cache: exact (through the store when ``reuse``), or blended."""
        core, canonical = self.core, prepared.canonical
        n_prompt, capacity = len(canonical), len(canonical) + prepared.max_new_tokens
        namespace = salted(core.namespace, prepared.request.cache_salt)
        if not chunked:  # plain generation: one forward over the whole prompt through the model's own cache
            chunks = [Chunk(0, n_prompt, "")]
        else:
            chunks = core.chunks(canonical, prepared.request.cache_salt)
        if prepared.mode == "blend" and chunked:
            with holding_writes(core.assembler):
                out = blend_prefill(
                    core.assembler,
                    core.blend_shifter(),
                    canonical,
                    chunks,
                    store=core.store,
                    registry=core.registry,
                    namespace=namespace,
                    settings=core.blend_settings(prepared.request.blend_recompute_ratio),
                    capacity=capacity,
                    store_last_logits=core.config.store_last_logits,
                    stop=cancel,
                )
        else:
            exact = prepared.mode == "exact" and reuse and chunked and core.assembler.invariant
            out = core.prefill(
                canonical.token_ids,
                chunks,
                store=core.store if reuse else None,
                capacity=capacity,
                store_last_logits=core.config.store_last_logits,
                reusable=chunked,
                stop=cancel,
                held=core.held.take(namespace, canonical.token_ids) if exact else None,
            )
            if reuse and chunked:
                out.unused_document_tokens = unused_document_tokens(
                    canonical,
                    sum(out.cached_by_tier.values()),
                    None,
                    registry=core.registry,
                    namespace=namespace,
                )
        self.unused.tell(prepared.mode, out.unused_document_tokens)
        return out


class DecodingBatch:
    """Requests decoding together on one :class:`~kvboost_rag.batch.RunningBatch`; others join it
    between its steps (:meth:`admit`), and each one's ``on_outcome`` hook hears of it as it leaves.

    A joining request must be able to run in a batch (:meth:`admit` hands back the others). The
    prefix that the rows share is kept once for all rows (a batch that started with a lone request
    takes it out of that request's cache when the first rows join) until a request without it
    joins; from then on each row holds its own copy.
    """

    def __init__(self, generation: Generation) -> None:
        self._generation = generation
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
        generation, core = self._generation, self._generation.core
        t_prefill = time.perf_counter()
        try:
            with core.lock:
                out = generation._prefill(prepared, True, prepared.mode != "off", hooks.cancel)
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
        stores_reply = Generation._stores_reply(prepared, core.config)
        self._running.adopt(row, keep_from=len(prepared.canonical) if stores_reply else None)
        chunks = core.chunks(prepared.canonical, prepared.request.cache_salt)
        self._lone_keys = [(c.key, c.end) for c in chunks]

    def admit(self, items: Sequence[tuple[Prepared, Hooks]]) -> list[Prepared]:
        """Prefill these requests' prefixes through the store and their last chunks as one batch; they
        decode with the running rows from the next step. Returns the requests that cannot join."""
        generation = self._generation
        core = generation.core
        blocker = core.assembler.batch_blocker
        refused: list[Prepared] = []
        rows: list[BatchRow] = []
        admitted: list[tuple[Prepared, Hooks]] = []  # of each row
        keys: list[list[tuple[str, int]]] = []  # (key, end) of each row's prefix chunks
        t_admit = time.perf_counter()
        with core.lock:
            for prepared, hooks in items:
                if not Generation._can_batch(prepared, blocker):
                    refused.append(prepared)
                    continue
                chunks = core.chunks(prepared.canonical, prepared.request.cache_salt)
                prefix_keys = [c.key for c in chunks[:-1]]  # the last chunk is prefilled per row
                if prefix_keys[: len(self._shared_keys)] != self._shared_keys:
                    assert self._running is not None  # only a running batch shares keys
                    self._running.unshare()  # this row lacks the shared prefix: rows hold their own
                    self._shared_keys = []
                try:
                    row = generation._batch_row(prepared, chunks, hooks.cancel, hooks.on_delta)
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
            and self._generation._store_reply_now(prepared, outcome.text, out.exact_cache, out.cache_ids)
        )
        if isinstance(outcome, GenerationResult) and out.exact_cache is not None:
            self._generation._hold(prepared, row.prefix, out.exact_cache, out.cache_ids)
        self._settle(prepared, hooks, outcome, reply_stored=reply_stored)

    def _settle(
        self, prepared: Prepared, hooks: Hooks, outcome: Outcome, *, reply_stored: bool = False
    ) -> None:
        if isinstance(outcome, GenerationResult) and not reply_stored:  # before the caller's next turn
            self._generation._follow_up(prepared, outcome)
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
        note = self._generation.core.reuse_note if p.mode == "exact" else None
        return _result(
            p,
            row.prefix,
            out.text,
            out.token_ids,
            finish,
            recomputed,
            timings,
            out.first_logits,
            note,
            out.speculation,
        )


def _result(
    prepared: Prepared,
    prefill: PrefillOutcome | None,
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


def _common_prefix_tokens(keys: Sequence[Sequence[tuple[str, int]]]) -> int:
    """Tokens of the leading chunks that every row has, from each row's chunk ``(key, end)`` list
    (the same keys: the same KV)."""
    shared = 0
    for column in zip(*keys, strict=False):  # up to the shortest list
        if any(entry != column[0] for entry in column):
            break
        shared = column[0][1]
    return shared
