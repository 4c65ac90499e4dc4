"""The FastAPI app: OpenAI-compatible endpoints over one :class:`~kvboost_rag.KVBoostEngine`, and
the uvicorn server that drains it on SIGTERM/SIGINT.

The pieces live beside this module: ``routes`` (the endpoints), ``service`` (admission,
generation, streaming and shutdown of one app), ``errors`` (OpenAI-shaped error bodies),
``protocol`` (request and response bodies) and ``metrics`` (Prometheus text).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import KVBoostEngine
from ..limits import ServerLimits
from .auth import ApiKeys
from .errors import validation_message
from .middleware import ApiKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from .protocol import error_body
from .routes import ENDPOINTS, router
from .service import Service


def create_app(
    engine: KVBoostEngine,
    *,
    model_name: str | None = None,
    max_queue: int = 64,
    request_timeout_s: float = 120.0,
    default_max_tokens: int = 256,
    shutdown_grace_s: float = 30.0,
    close_engine: bool = True,
    api_keys: ApiKeys | Sequence[str] = (),
    metrics_public: bool = False,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """An OpenAI-compatible FastAPI app over ``engine``.

    ``model_name`` is what ``/v1/models`` lists and responses report (default: the
    engine's model name). Requests may name any model: a local server serves the
    one it has loaded, and clients written for other servers send their own names.
    ``max_queue`` bounds the generation requests admitted at once (running or
    waiting); beyond it requests get 429. ``request_timeout_s`` bounds each
    request, stream included (504, or an error event in a stream), and stops
    its generation. ``default_max_tokens`` applies when a request sets no
    ``max_tokens``. On shutdown the app admits nothing more, waits up to
    ``shutdown_grace_s`` for admitted requests, stops the rest and, with
    ``close_engine``, closes the engine, which flushes pending store writes.

    With ``api_keys``, requests need ``Authorization: Bearer <key>`` (else 401), except
    ``/health`` and, with ``metrics_public``, ``/metrics``. ``limits`` bound what one request
    may ask for (:class:`~kvboost_rag.limits.ServerLimits`; its defaults when None).

    >>> app = create_app(engine, model_name="smollm2-135m-instruct")  # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1 (got {max_queue})")
    if request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s must be > 0 (got {request_timeout_s})")
    service = Service(
        engine,
        model_name=model_name or engine.model_name,
        max_queue=max_queue,
        request_timeout_s=request_timeout_s,
        default_max_tokens=default_max_tokens,
        shutdown_grace_s=shutdown_grace_s,
        close_engine=close_engine,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await service.shutdown()

    app = FastAPI(
        title="kvboost-rag", summary="OpenAI-compatible server with KV-cache reuse", lifespan=lifespan
    )
    app.state.kvboost = service  # the routes' `service` dependency reads it from here
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys(api_keys)
    open_paths = {"/health", "/metrics"} if metrics_public else {"/health"}
    app.state.limits = limits or ServerLimits()
    app.add_middleware(BodyLimitMiddleware, max_bytes=app.state.limits.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=keys, open_paths=open_paths)  # before the body is read
    app.add_middleware(MetricsMiddleware, metrics=service.metrics)  # outermost: it counts the 401s too
    app.exception_handler(RequestValidationError)(_invalid_body)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.include_router(router)
    return app


async def _invalid_body(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
    """pydantic's complaint about a body as an OpenAI 400 that names the field."""
    return JSONResponse(error_body(*validation_message(exc.errors())), status_code=400)


async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's HTTP errors (404, 405, ...) in OpenAI's shape; a 404 lists what is served."""
    code = "not_found" if exc.status_code == 404 else None
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        detail = f"{detail}: this server offers {', '.join(ENDPOINTS)}"
    return JSONResponse(error_body(detail, "invalid_request_error", None, code), status_code=exc.status_code)


# -- running -------------------------------------------------------------------------------------


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which stops admitting requests as soon as shutdown begins (SIGTERM, SIGINT),
    before it waits for the open connections."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self._service = service

    async def shutdown(self, sockets: Any = None) -> None:
        self._service.begin_drain()
        await super().shutdown(sockets=sockets)


def create_server(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for ``app`` that drains on SIGTERM/SIGINT within the app's shutdown grace period.

    ``server.run()`` blocks; ``server.run(sockets=[sock])`` serves an already bound socket.
    """
    service: Service = app.state.kvboost
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        # uvicorn waits this long for open responses, then cancels them; the app's own shutdown
        # follows in what is left of the grace period. Its hint says int, but it hands the value to
        # asyncio.timeout, so fractions of a second work.
        timeout_graceful_shutdown=service.shutdown_grace_s - service.stop_s,  # type: ignore[arg-type]
    )
    return _DrainingServer(config, service)


def serve(
    engine: KVBoostEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    **app_options: Any,
) -> None:
    """Serve ``engine`` over HTTP until SIGTERM/SIGINT, then drain and close it.

    ``app_options`` are those of :func:`create_app` (``model_name``, ``max_queue``,
    ``request_timeout_s``, ``default_max_tokens``, ``shutdown_grace_s``, ``api_keys``,
    ``metrics_public``).
    """
    app = create_app(engine, **app_options)
    create_server(app, host=host, port=port, log_level=log_level).run()
