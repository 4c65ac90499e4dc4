"""Scheduler: requests from concurrent callers are served in batches by one worker thread.

A batch starts from the requests queued when the worker is free: it waits at most
``window_s`` after the oldest queued one for others to join it (0: no wait). While the
batch runs, requests that arrive join it between its decode steps (continuous
batching), up to ``max_batch_size`` rows; a request that cannot join (it must run
alone, or shares nothing with the running rows) is first in line for the next batch,
and the running one takes nobody else meanwhile, so it drains and nobody waits behind
a batch that never ends.

Latency and throughput: a lone request pays at most the window; a batch of B
requests decodes B tokens per forward pass, which on a CPU costs far less than
B passes (the weights are read once), so throughput grows with B while each
request's time per token grows a little. A request that arrives mid-batch waits for
at most the step in progress before its prefill starts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .openmp import release_pool

R = TypeVar("R")
T = TypeVar("T")


class BatchFuture(Future, Generic[T]):
    """A future whose ``cancel()`` also stops a request that is already running (at its next token)."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_requested = threading.Event()

    def cancel(self) -> bool:
        self.cancel_requested.set()
        return super().cancel()

    def settle(self, outcome: T | BaseException) -> None:
        """Complete with a result, or with an exception, unless already done."""
        if self.done():
            return
        if isinstance(outcome, BaseException):
            self.set_exception(outcome)
        else:
            self.set_result(outcome)


@dataclass
class Pending(Generic[R]):
    request: R
    """What was submitted; the batch may replace it by a prepared form if it hands it back."""
    submitted_at: float
    future: BatchFuture = field(default_factory=BatchFuture)
    on_delta: Callable[[str], None] | None = None
    """Called on the worker thread with each piece of new text, as the request's tokens come out."""

    def start(self) -> bool:
        """Mark the request running; False when it was cancelled first (drop it)."""
        return self.future.running() or self.future.set_running_or_notify_cancel()


class Arrivals(Generic[R]):
    """What a running batch is offered between its steps: requests queued since it started."""

    def __init__(self, scheduler: Scheduler[R], members: list[Pending[R]]) -> None:
        self._scheduler = scheduler
        self._members = members
        self._closed = False

    def take(self, limit: int) -> list[Pending[R]]:
        """Up to ``limit`` queued requests (started), oldest first; none once one was handed back."""
        if self._closed or limit <= 0:
            return []
        taken = [p for p in self._scheduler._take(limit) if p.start()]
        self._members.extend(taken)
        return taken

    def hand_back(self, pending: Sequence[Pending[R]]) -> None:
        """Requests that cannot join: they head the queue for the next batch, and this batch takes
        no one else (it drains)."""
        if not pending:
            return
        self._closed = True
        for p in pending:
            self._members.remove(p)
        self._scheduler._requeue(pending)


Serve = Callable[[Sequence[Pending[R]], Arrivals[R]], None]
"""Runs a batch of started requests, settling each one's future (``future.settle``), and offers the
batch ``Arrivals`` between its steps."""


class Scheduler(Generic[R]):
    """Collects submitted requests into batches and runs them with ``serve`` on a worker thread."""

    def __init__(self, serve: Serve[R], *, window_s: float, max_batch_size: int) -> None:
        self._serve_batch = serve
        self._window_s = window_s
        self._max_batch_size = max_batch_size
        self._queue: deque[Pending[R]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="kvboost-scheduler", daemon=True)
        self._worker.start()

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    def submit(self, request: R, on_delta: Callable[[str], None] | None = None) -> BatchFuture:
        pending = Pending(request, time.perf_counter(), on_delta=on_delta)
        release_pool()  # the caller waits for the worker now: its OpenMP workers would slow the worker's
        with self._ready:
            if self._closed:
                raise RuntimeError("the engine is closed; create a new one to generate")
            self._queue.append(pending)
            self._ready.notify()
        return pending.future

    def close(self) -> None:
        """Finish what is queued, then stop the worker."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if threading.current_thread() is not self._worker:
            self._worker.join()

    def _take(self, limit: int) -> list[Pending[R]]:
        with self._ready:
            return [self._queue.popleft() for _ in range(min(len(self._queue), limit))]

    def _requeue(self, pending: Sequence[Pending[R]]) -> None:
        with self._ready:
            self._queue.extendleft(reversed(pending))

    def _next_batch(self) -> list[Pending[R]] | None:
        with self._ready:
            while not self._queue:
                if self._closed:
                    return None
                self._ready.wait()
            deadline = self._queue[0].submitted_at + self._window_s
            while len(self._queue) < self._max_batch_size and not self._closed:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._ready.wait(remaining)
            return [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch_size))]

    def _serve(self) -> None:
        while True:
            if not self._queue:  # idle until the next request: others may compute meanwhile
                release_pool()
            batch = self._next_batch()
            if batch is None:
                return
            members = [p for p in batch if p.start()]
            if not members:
                continue
            error: BaseException = RuntimeError("the batch ended without an outcome for this request")
            try:
                self._serve_batch(list(members), Arrivals(self, members))
            except BaseException as e:  # a bug in the batch path: fail these requests, keep serving
                error = e
            for pending in members:
                pending.future.settle(error)  # no effect on those settled as their rows ended
