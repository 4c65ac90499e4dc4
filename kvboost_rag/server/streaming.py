"""From the engine's blocking stream to server-sent events on the event loop.

:class:`StreamBridge` runs the engine's synchronous iterator on a thread of its own and hands
each item to the loop with ``call_soon_threadsafe``; :class:`EventStream` is the HTTP response
that sends the events and runs a cleanup however the response ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Final

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..results import StreamChunk

END: Final = object()
"""Queued after the last item, however the engine's stream ended."""


class StreamBridge:
    """Runs an engine stream on its own thread and queues its items for the event loop.

    The engine's stream is a plain iterator whose steps block (prefill, decode); a
    dedicated thread per stream keeps those steps off the loop and out of the
    small default executor. :meth:`stop` ends it: an engine stream
    (:class:`~kvboost_rag.generation.CancellableStream`) at its next layer or token, a
    long prefill included; any iterator before its next item is handed over.

    The queue receives each :class:`~kvboost_rag.engine.StreamChunk`, then an exception if the
    stream raised, then :data:`END`; ``on_exit`` runs on the loop once the thread is done.
    """

    def __init__(
        self,
        steps: Iterator[StreamChunk],
        loop: asyncio.AbstractEventLoop,
        on_exit: Callable[[StreamBridge], None],
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
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which reports it in the stream
            self._hand_over(e)
        finally:
            try:
                close = getattr(self.steps, "close", None)
                if close is not None:
                    close()  # a generator left half-way stops here, releasing what it holds
            finally:
                self._hand_over(END)
                try:
                    self.loop.call_soon_threadsafe(self._on_exit, self)
                except RuntimeError:
                    pass


class EventStream(StreamingResponse):
    """A server-sent event stream whose ``on_close`` runs however the response ends (done, client gone,
    cancelled), even when the body iterator never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            # proxies (nginx) must pass each event on at once rather than buffer the response
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
