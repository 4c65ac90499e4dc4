"""ASGI middleware that records every HTTP exchange in the server's metrics."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import ServerMetrics
from .routes import endpoint_label


class MetricsMiddleware:
    """Counts every HTTP exchange by endpoint and status, and times it to its last byte.

    Pure ASGI rather than ``BaseHTTPMiddleware``: a streamed response is timed until its
    last event, and nothing is buffered between the app and the client.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope.get("path", ""))
        status = 500  # what the exchange counts as if the app raises before answering
        t0 = time.perf_counter()

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self.metrics.record_request(endpoint, status, time.perf_counter() - t0)
