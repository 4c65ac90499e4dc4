"""Scheduler: requests from concurrent callers are served in batches by one worker thread.

A request waits at most ``window_s`` after the oldest queued one for others to
join its batch (0: no wait). Under load no waiting is needed: requests that
arrive while a batch runs queue up and form the next batch together.

Latency and throughput: a lone request pays at most the window; a batch of B
requests decodes B tokens per forward pass, which on a CPU costs far less than
B passes (the weights are read once), so throughput grows with B while each
request's time per token grows a little.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

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
    submitted_at: float
    future: BatchFuture = field(default_factory=BatchFuture)
    on_delta: Callable[[str], None] | None = None
    """Called on the worker thread with each piece of new text, as the request's tokens come out."""


class Scheduler(Generic[R]):
    """Collects submitted requests into batches and runs them with ``run_batch`` on a worker thread.

    ``run_batch(pending)`` returns one result or exception per request, in order.
    """

    def __init__(
        self,
        run_batch: Callable[[Sequence[Pending[R]]], Sequence[Any]],
        *,
        window_s: float,
        max_batch_size: int,
    ) -> None:
        self._run_batch = run_batch
        self._window_s = window_s
        self._max_batch_size = max_batch_size
        self._queue: deque[Pending[R]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="kvboost-scheduler", daemon=True)
        self._worker.start()

    def submit(self, request: R, on_delta: Callable[[str], None] | None = None) -> BatchFuture:
        pending = Pending(request, time.perf_counter(), on_delta=on_delta)
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
        while (batch := self._next_batch()) is not None:
            live = [p for p in batch if p.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                outcomes = self._run_batch(live)
            except BaseException as e:  # a bug in the batch path: fail these requests, keep serving
                outcomes = [e] * len(live)
            for pending, outcome in zip(live, outcomes, strict=True):
                pending.future.settle(outcome)  # most were settled as their rows ended
