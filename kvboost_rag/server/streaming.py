"""Server-sent events: :class:`EventStream` is the HTTP response that sends a stream's events and
runs a cleanup however the response ends (the engine's stream reaches the loop through
:class:`~kvboost_rag.async_stream.StreamBridge`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


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
