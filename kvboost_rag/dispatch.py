"""Where the engine's requests run: alone in the calling thread (``max_batch_size=1``), or served
by the batching scheduler, which starts at the first request; and the stream, blocking or for
asyncio, that each way gives."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial

from .async_stream import Feed, ScheduledFeed, StreamBridge
from .config import EngineConfig
from .generation import Generation
from .prepared import OnDelta, Prepared
from .request import Request
from .results import GenerationResult
from .scheduler import BatchFuture, Scheduler
from .streams import CancellableStream, ScheduledStream


class Dispatcher:
    """Hands requests to a :class:`~kvboost_rag.generation.Generation`, directly or through a
    :class:`~kvboost_rag.scheduler.Scheduler` of its own (started at the first request that needs
    it; :meth:`close` ends it)."""

    def __init__(self, generation: Generation, config: EngineConfig) -> None:
        self._generation = generation
        self._config = config
        self._scheduler: Scheduler[Request | Prepared] | None = None
        self._lock = threading.Lock()

    def run(self, request: Request) -> GenerationResult:
        """The request's result, from this thread (``max_batch_size=1``) or the scheduler's batches."""
        generation = self._generation
        if self._config.max_batch_size == 1:
            return generation.solo(generation.prepare(request, time.perf_counter()))
        future = self.submit(request)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting: the row leaves its batch at the next token
            raise

    def submit(self, request: Request | Prepared, on_delta: OnDelta | None = None) -> BatchFuture:
        """Queue a request (a stream's comes prepared) for the scheduler; a future of its result."""
        with self._lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(
                    self._generation.serve,
                    window_s=self._config.batch_window_ms / 1000,
                    max_batch_size=self._config.max_batch_size,
                )
        return self._scheduler.submit(request, on_delta)

    def stream(self, prepared: Prepared) -> CancellableStream | ScheduledStream:
        """The request's deltas: run in the thread that reads them, or served by the scheduler."""
        if self._config.max_batch_size == 1:
            return CancellableStream(self._generation, prepared)
        return ScheduledStream(self.submit, prepared, self._config.stream_buffer_deltas)

    def feed(self, prepared: Prepared, loop: asyncio.AbstractEventLoop) -> Feed:
        """The request's deltas handed to ``loop`` (see :mod:`.async_stream`)."""
        if self._config.max_batch_size == 1:  # the request runs alone, on a thread of its own
            return StreamBridge(CancellableStream(self._generation, prepared), loop)
        submit = partial(self.submit, prepared)
        return ScheduledFeed(submit, loop, self._config.stream_buffer_deltas)

    def close(self) -> None:
        """Finish the queued requests and stop the scheduler (a later request starts a new one)."""
        with self._lock:
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.close()
