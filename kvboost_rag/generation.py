"""The request driver: prepared requests run alone (the exact path, streamed token by token) or,
where several can share one, together in a :class:`~kvboost_rag.decoding_batch.DecodingBatch`;
and the choice of each request's prefill, which both paths take.

The scheduler's batches come in through :meth:`Generation.serve`: requests are prepared
(:mod:`.prepared`), those that cannot share a batch (blend mode, sliding windows) run alone,
the others together, and requests that arrive meanwhile join the batch between its decode
steps. What a finished request leaves for the next one is :mod:`.next_turn`'s; its result is
built by :func:`~kvboost_rag.result_builder.build_result`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import CancelledError
from functools import partial

from .batch import BatchRow
from .blend import blend_prefill
from .core import EngineCore
from .decoding import DecodeStepper, decode
from .decoding_batch import DecodingBatch, can_batch
from .followups import FollowUps
from .keys import Chunk, salted
from .next_turn import NextTurn
from .prepared import Hooks, OnDelta, Outcome, Prepared, prepare_request
from .request import Request
from .result_builder import build_result
from .results import FinishReason, GenerationResult, StreamChunk, Timings
from .runner import PrefillOutcome, holding_writes
from .scheduler import Arrivals, Pending
from .textstream import TextStream
from .unused_documents import UnusedDocuments, unused_document_tokens

logger = logging.getLogger(__name__)


class Generation:
    """Runs prepared requests on an :class:`~kvboost_rag.core.EngineCore`.

    Chat answers in exact mode are followed by storing the reply as the next turn
    renders it (``EngineConfig.store_replies``), queued on ``followups`` (see :mod:`.next_turn`).
    """

    def __init__(self, core: EngineCore, followups: FollowUps) -> None:
        self.core = core
        self.followups = followups
        self.next_turn = NextTurn(core, followups)
        self.unused = UnusedDocuments()

    def prepare(self, request: Request, submitted_at: float) -> Prepared:
        """Canonicalize a request and fit it to the context window (bad input raises here, before work)."""
        return prepare_request(self.core, request, submitted_at)

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
            if can_batch(prepared, blocker):
                together.append((prepared, hooks))
            else:
                self._solo_outcome(prepared, hooks)
        if not together:
            return None
        # the bound ``_batch_row`` read per batch: a replacement set on this instance takes effect
        batch = DecodingBatch(
            self.core, self.next_turn, prefill_alone=self.prefill_alone, make_row=self._batch_row
        )
        if len(together) == 1:
            batch.start_lone(*together[0])  # the exact single-request path, until others join
        else:
            batch.admit(together)
        return batch if len(batch) else None

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
            self.next_turn.follow_up(prepared, last.result)
        yield last

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
            out = self.prefill(prepared, chunked=blocker is None, reuse=reuse, cancel=cancel)
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
            keep_from=n_prompt if self.next_turn.stores_reply(prepared) else None,
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
        reply_stored = stepper.exact and self.next_turn.store_reply_now(
            prepared, text.text, out.cache, cache_ids
        )
        if stepper.exact:
            self.next_turn.hold(prepared, out, out.cache, cache_ids)
        t0 = prepared.submitted_at
        ttft = (first_token_at - t0) if first_token_at else 0.0
        timings = Timings(ttft, time.perf_counter() - t0, prefill_s, out.select_s)
        note = blocker or (core.reuse_note if reuse else None)
        result = build_result(
            prepared,
            out,
            text=text.text,
            token_ids=list(text.ids),
            finish=finish,
            recomputed_tokens=out.recomputed_tokens,
            timings=timings,
            first_logits=out.logits,
            reuse_note=note,
            speculation=stepper.stats,
        )
        return StreamChunk(tail, result), reply_stored

    def prefill_alone(self, prepared: Prepared, cancel: threading.Event | None) -> PrefillOutcome:
        """The whole prompt's cache as a lone request's prefill makes it: by chunks, through the store
        unless reuse is off (what a batch row that must compute some chunks takes too)."""
        return self.prefill(prepared, chunked=True, reuse=prepared.mode != "off", cancel=cancel)

    def prefill(
        self, prepared: Prepared, *, chunked: bool, reuse: bool, cancel: threading.Event | None
    ) -> PrefillOutcome:
        """The prompt's cache: exact (through the store when ``reuse``), or blended; ``chunked=False``
        is plain generation, one forward over the whole prompt."""
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
            whole = self.prefill_alone(p, cancel)
            return row(whole, len(ids), on_delta=on_delta)
        prefix = None
        if len(chunks) > 1:
            prefix = core.prefill(
                ids, chunks[:-1], store=store, capacity=chunks[-1].start, need_logits=False, stop=cancel
            )
        return row(prefix, chunks[-1].start, on_delta=on_delta)
