"""From the engine to asyncio: a request's items reach the event loop through a *feed*.

:class:`ScheduledFeed` serves a request through the engine's batching scheduler and hands
each delta to the loop by callback (``call_soon_threadsafe``) as its tokens come out of the
shared step: no thread waits for it. :class:`StreamBridge` runs a blocking stream (a request
alone in the calling thread, ``max_batch_size=1``) on a thread of its own and hands its
items over the same way. :class:`AsyncStream` (what :meth:`KVBoostEngine.astream
<kvboost_rag.KVBoostEngine.astream>` returns) is the async iterator over either.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Final, Protocol

from .errors import StreamOverflowError
from .results import StreamChunk

END: Final = object()
"""Queued after the last item, however the engine's stream ended."""


class Feed(Protocol):
    """What :class:`AsyncStream` reads: items on the loop's queue, ended by :data:`END`."""

    queue: asyncio.Queue[Any]
    """Stream chunks, an exception if the request failed, then :data:`END`."""

    def start(self) -> None: ...

    def stop(self) -> None:
        """Stop the request at its next layer or token (from any thread; no effect once it ended)."""
        ...

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called (or the reader fell too far behind)."""
        ...

    @property
    def started(self) -> bool:
        """True once the first item (a delta or the result) is out."""
        ...

    @property
    def done(self) -> bool:
        """True once the request has let go of the model."""
        ...

    def wait_done(self, timeout_s: float) -> None:
        """Block until the request has let go of the model (or ``timeout_s`` passed)."""
        ...


class Delivery:
    """Hands the items of a request served by the batching scheduler to its reader, on the
    scheduler's thread: each delta as a :class:`StreamChunk`, then a last chunk that carries the
    result (or the error), then :data:`END`.

    ``put(item)`` must not block: the batch never waits for a reader. Past ``max_buffered``
    items that ``backlog()`` says are unread, the request is stopped and its reader gets
    :class:`~kvboost_rag.errors.StreamOverflowError`.
    """

    def __init__(self, put: Callable[[Any], None], backlog: Callable[[], int], max_buffered: int) -> None:
        self._put = put
        self._backlog = backlog
        self._max_buffered = max_buffered
        self._future: Future | None = None
        self._overflowed = False
        self._stop_requested = False
        self.started = False

    def begin(self, submit: Callable[[Callable[[str], None]], Future]) -> None:
        """Queue the request: ``submit(on_delta)`` returns its future."""
        self._future = submit(self._on_delta)
        self._future.add_done_callback(self._on_done)  # after the last delta, on the same thread

    def stop(self) -> None:
        self._stop_requested = True
        if self._future is not None and not self._future.done():
            self._future.cancel()

    @property
    def stopped(self) -> bool:
        return self._stop_requested or self._overflowed

    @property
    def done(self) -> bool:
        return self._future is not None and self._future.done()

    def wait_done(self, timeout_s: float) -> None:
        if self._future is not None:
            wait_futures([self._future], timeout_s)

    def _on_delta(self, text: str) -> None:
        self.started = True
        if self._overflowed:
            return
        if self._backlog() >= self._max_buffered:
            self._overflowed = True
            self.stop()
            return
        self._put(StreamChunk(text))

    def _on_done(self, future: Future) -> None:
        self.started = True
        if self._overflowed:
            msg = (
                f"the stream's reader fell behind by more than {self._max_buffered} deltas and the "
                "request was stopped; read the stream as it comes, or raise "
                "EngineConfig.stream_buffer_deltas"
            )
            self._put(StreamOverflowError(msg))
        elif future.cancelled():
            self._put(CancelledError())
        elif (error := future.exception()) is not None:
            self._put(error)
        else:
            self._put(StreamChunk("", future.result()))
        self._put(END)


class ScheduledFeed(Delivery):
    """A request served by the batching scheduler, its items handed to the event loop by callback
    (``call_soon_threadsafe``) as its tokens come out of the shared step: no thread waits for it.

    ``submit(on_delta)`` queues the request and returns its future (see :class:`Delivery`).
    """

    def __init__(
        self,
        submit: Callable[[Callable[[str], None]], Future],
        loop: asyncio.AbstractEventLoop,
        max_buffered: int,
    ) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.loop = loop
        self._submit = submit
        super().__init__(self._hand_over, self.queue.qsize, max_buffered)

    def start(self) -> None:
        self.begin(self._submit)

    def _hand_over(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class StreamBridge:
    """Runs an engine stream on its own thread and queues its items for the event loop.

    :meth:`stop` ends it: an engine stream (:class:`~kvboost_rag.streams.CancellableStream`)
    at its next layer or token, a long prefill included; any iterator before its next item is
    handed over.

    The queue receives each :class:`~kvboost_rag.results.StreamChunk`, then an exception if the
    stream raised, then :data:`END`.
    """

    def __init__(self, steps: Iterator[StreamChunk], loop: asyncio.AbstractEventLoop) -> None:
        self.steps = steps
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        """Items for the loop: stream chunks, an exception, then :data:`END`."""
        self.cancel = threading.Event()
        """Set by :meth:`stop`: no item is handed over after it."""
        self.started = False
        """True once the first item (a delta or the result) is out."""
        self.thread = threading.Thread(target=self._pump, name="kvboost-stream", daemon=True)

    def start(self) -> None:
        """Start pumping the engine's stream on the bridge's thread."""
        self.thread.start()

    def stop(self) -> None:
        """Stop the stream (from any thread): at once where the engine's stream can be cancelled."""
        self.cancel.set()
        cancel = getattr(self.steps, "cancel", None)
        if cancel is not None:
            cancel()

    @property
    def stopped(self) -> bool:
        return self.cancel.is_set()

    @property
    def done(self) -> bool:
        return self.thread.ident is not None and not self.thread.is_alive()

    def wait_done(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def _hand_over(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _pump(self) -> None:
        try:
            for item in self.steps:
                if self.cancel.is_set():
                    break
                self.started = True
                self._hand_over(item)
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it to the reader
            self._hand_over(e)
        finally:
            try:
                close = getattr(self.steps, "close", None)
                if close is not None:
                    close()  # a generator left half-way stops here, releasing what it holds
            finally:
                self._hand_over(END)


class AsyncStream(AsyncIterator[StreamChunk]):
    """Text deltas of one request for ``async for``, then a last item that carries its result.

    ``open_feed(loop)`` prepares the request (in a worker thread: tokenization may take a
    while) and returns its :class:`Feed`; that happens on first use, or at :meth:`start`, which
    raises bad input before anything is generated. Leaving the loop early, :meth:`aclose`, or
    cancelling the reading task stops the request at its next layer or token.

    Example:
        .. code-block:: python

            async for piece in engine.astream("Why is the sky blue?", max_new_tokens=32):
                print(piece.text, end="")
            print(piece.result.usage)
    """

    def __init__(self, open_feed: Callable[[asyncio.AbstractEventLoop], Feed]) -> None:
        self._open_feed = open_feed
        self.feed: Feed | None = None
        """The request's feed, once started."""
        self._cancelled = False
        self._done = False

    async def start(self) -> None:
        """Prepare the request and start generating (bad input raises here)."""
        if self.feed is None and not self._cancelled:
            self.feed = await asyncio.to_thread(self._open_feed, asyncio.get_running_loop())
            self.feed.start()
            if self._cancelled:  # cancelled while it was prepared
                self.feed.stop()

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        if self.feed is None:
            item: Any = END
        else:
            try:
                item = await self.feed.queue.get()
            except BaseException:  # the reading task was cancelled: so is the request
                self.cancel()
                raise
        if item is END:
            self._done = True
            if self._cancelled:
                raise CancelledError("the stream was cancelled before its result")
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        chunk: StreamChunk = item
        if chunk.result is not None:
            self._done = True
        return chunk

    def cancel(self) -> None:
        """Stop the request at its next layer or token (safe from any thread); reading on then raises
        ``concurrent.futures.CancelledError``."""
        self._cancelled = True
        if self.feed is not None:
            self.feed.stop()

    async def aclose(self) -> None:
        """End the stream here; a request still running stops at its next layer or token."""
        if not self._done:
            self._done = True
            self.cancel()
