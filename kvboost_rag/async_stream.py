"""From the engine's blocking stream to asyncio: :class:`StreamBridge` and :class:`AsyncStream`.

The engine's stream is a plain iterator whose steps block (prefill, decode).
:class:`StreamBridge` runs it on a thread of its own and hands each item to the event
loop with ``call_soon_threadsafe``, so the loop never waits on a worker per item and the
small default executor is not held by long streams. :class:`AsyncStream` (what
:meth:`KVBoostEngine.astream <kvboost_rag.KVBoostEngine.astream>` returns) is the async
iterator over a bridge that the adapters and the server use.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import CancelledError
from typing import Any, Final

from .results import StreamChunk

END: Final = object()
"""Queued after the last item, however the engine's stream ended."""


class StreamBridge:
    """Runs an engine stream on its own thread and queues its items for the event loop.

    :meth:`stop` ends it: an engine stream (:class:`~kvboost_rag.generation.CancellableStream`)
    at its next layer or token, a long prefill included; any iterator before its next item is
    handed over.

    The queue receives each :class:`~kvboost_rag.results.StreamChunk`, then an exception if the
    stream raised, then :data:`END`; ``on_exit`` runs on the loop once the thread is done.
    """

    def __init__(
        self,
        steps: Iterator[StreamChunk],
        loop: asyncio.AbstractEventLoop,
        on_exit: Callable[[StreamBridge], None] | None = None,
    ) -> None:
        self.steps = steps
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        """Items for the loop: stream chunks, an exception, then :data:`END`."""
        self.cancel = threading.Event()
        """Set by :meth:`stop`: no item is handed over after it."""
        self.started = False
        """True once the first item (a delta or the result) is out."""
        self._on_exit = on_exit
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
                if self._on_exit is not None:
                    try:
                        self.loop.call_soon_threadsafe(self._on_exit, self)
                    except RuntimeError:
                        pass


class AsyncStream(AsyncIterator[StreamChunk]):
    """Text deltas of one request for ``async for``, then a last item that carries its result.

    The request is prepared on first use (or by :meth:`start`, which raises bad input before
    anything is generated), off the event loop; leaving the loop early, :meth:`aclose`, or
    cancelling the reading task stops the request at its next layer or token.

    Example:
        .. code-block:: python

            async for piece in engine.astream("Why is the sky blue?", max_new_tokens=32):
                print(piece.text, end="")
            print(piece.result.usage)
    """

    def __init__(self, open_steps: Callable[[], Iterator[StreamChunk]]) -> None:
        self._open_steps = open_steps
        self._bridge: StreamBridge | None = None
        self._cancelled = False
        self._done = False

    async def start(self) -> None:
        """Prepare the request and start generating (bad input raises here)."""
        if self._bridge is None and not self._cancelled:
            steps = await asyncio.to_thread(self._open_steps)  # tokenization may take a while
            self._bridge = StreamBridge(steps, asyncio.get_running_loop())
            self._bridge.start()
            if self._cancelled:  # cancelled while it was prepared
                self._bridge.stop()

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        if self._bridge is None:
            item: Any = END
        else:
            try:
                item = await self._bridge.queue.get()
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
        if self._bridge is not None:
            self._bridge.stop()

    async def aclose(self) -> None:
        """End the stream here; a request still running stops at its next layer or token."""
        if not self._done:
            self._done = True
            self.cancel()
