"""Streams: one request's text deltas as a blocking iterator, then a last item that carries its
result (what :meth:`KVBoostEngine.stream <kvboost_rag.KVBoostEngine.stream>` returns).

:class:`CancellableStream` runs its request alone, in the thread that iterates it
(``max_batch_size=1``); :class:`ScheduledStream` has it served by the batching scheduler and
reads its items from a queue. Either stops its request at the next layer or token on
:meth:`cancel`, from any thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import Any, Protocol

from .async_stream import END, Delivery
from .prepared import OnDelta, Prepared
from .results import StreamChunk
from .scheduler import BatchFuture


class RunsAlone(Protocol):
    """What a :class:`CancellableStream` runs its request on: a
    :class:`~kvboost_rag.generation.Generation`."""

    def stream(
        self, prepared: Prepared, cancel: threading.Event | None = None
    ) -> Generator[StreamChunk, None, None]: ...


class CancellableStream(Iterator[StreamChunk]):
    """Text deltas of one request, then a last item that carries its result (see
    :meth:`KVBoostEngine.stream`).

    :meth:`cancel`, from any thread, stops the request at its next layer or token, in a long
    prefill too; the stream then raises ``concurrent.futures.CancelledError``.
    """

    def __init__(self, generation: RunsAlone, prepared: Prepared) -> None:
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
