"""ASGI middleware: metrics of every HTTP exchange, API keys, and bounded request bodies."""

from __future__ import annotations

import time
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import TENANT_STATE, ApiKeys
from .metrics import ServerMetrics
from .protocol import error_body
from .routes import endpoint_label


class HTTPMiddleware:
    """Pure ASGI middleware for HTTP exchanges: anything else (lifespan) passes straight through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class MetricsMiddleware(HTTPMiddleware):
    """Counts every HTTP exchange by endpoint and status, and times it to its last byte.

    Pure ASGI rather than ``BaseHTTPMiddleware``: a streamed response is timed until its
    last event, and nothing is buffered between the app and the client.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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


class BodyLimitMiddleware(HTTPMiddleware):
    """Answers 413 to a request body over ``max_bytes``, declared or streamed, before the app parses it.

    The body is read here (at most ``max_bytes`` of it) and handed to the app in one piece;
    what the client sends after it (a disconnect) still reaches the app.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it as it would
                await self.app(scope, _replay(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            more = message.get("more_body", False)
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over this server's {self.max_bytes}-byte limit; send less"
        body = error_body(message, "invalid_request_error", None, "request_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    """``receive`` that answers ``first`` once, then passes through."""
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


class ApiKeyMiddleware(HTTPMiddleware):
    """Answers 401 (OpenAI's shape, ``WWW-Authenticate: Bearer``) to requests without a valid key,
    except on the ``open_paths``."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: Iterable[str]) -> None:
        super().__init__(app)
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        raw = headers.get(b"authorization")
        tenant = self.keys.tenant(raw.decode("latin-1")) if raw is not None else None
        if tenant is not None:
            scope.setdefault("state", {})[TENANT_STATE] = tenant  # each key is a tenant of the KV cache
            await self.app(scope, receive, send)
            return
        if raw is None:
            message = "no API key: send the header 'Authorization: Bearer <key>' with a key of this server"
        else:
            message = "the API key is not valid for this server; check the key the client sends"
        body = error_body(message, "invalid_request_error", None, "invalid_api_key")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
