"""The FastAPI app: OpenAI-compatible endpoints over one :class:`~kvboost_rag.KVBoostEngine`.

Concurrency model: the event loop never runs model code. Non-streaming requests
are handed to the engine's batching scheduler (``engine.submit``), so concurrent
requests share batches. A stream runs the engine's synchronous iterator on its
own thread, which hands each delta to the loop with ``call_soon_threadsafe``.
Every generation request holds one admission ticket from arrival to its last
byte; at most ``max_queue`` are held at once and the next request gets 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import KVBoostEngine, StreamChunk
from ..engine import Request as EngineRequest
from ..errors import ContextWindowExceededError, InvalidRequestError, KVBoostError, UnsupportedModelError
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    Shaper,
    chat_messages,
    completion_prompt,
    error_body,
    sampling_kwargs,
    sse,
)

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/models", "/health", "/metrics")


class ServerError(Exception):
    """A refusal with an HTTP status and an OpenAI error ``type`` and ``code``."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code = status, type_, code


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI-shaped error response for an exception raised while serving a request."""
    headers = None
    if isinstance(exc, ServerError):
        status, body = exc.status, error_body(str(exc), exc.type, None, exc.code)
        if exc.status in (429, 503):
            headers = {"Retry-After": "1"}
    elif isinstance(exc, BadRequest):
        status, body = 400, error_body(str(exc), "invalid_request_error", exc.param, exc.code)
    elif isinstance(exc, ContextWindowExceededError):
        status, body = 400, error_body(str(exc), "invalid_request_error", None, "context_length_exceeded")
    elif isinstance(exc, (InvalidRequestError, UnsupportedModelError)):
        status, body = 400, error_body(str(exc), "invalid_request_error")
    elif isinstance(exc, KVBoostError):
        status, body = 500, error_body(str(exc), "server_error")
    else:
        logger.error("request failed", exc_info=exc)
        msg = f"the server failed to serve this request ({type(exc).__name__}: {exc}); see the server log"
        status, body = 500, error_body(msg, "server_error")
    return JSONResponse(body, status_code=status, headers=headers)


# -- admission -----------------------------------------------------------------------------------


class Ticket:
    """One admitted generation request."""

    def __init__(self) -> None:
        self.waiting: Callable[[], bool] = lambda: True
        """Whether the request has not started generating yet (for the queue-depth gauge)."""
        self.cancel: Callable[[], None] = lambda: None
        """Stops the request's work (at its next token)."""


class Admission:
    """At most ``capacity`` requests admitted at once, in flight or waiting; nothing while draining.

    Used from the event loop only, so plain counters suffice.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tickets: set[Ticket] = set()
        self.draining = False
        self._idle: asyncio.Event | None = None

    def admit(self) -> Ticket:
        if self.draining:
            raise ServerError(
                503,
                "the server is shutting down; retry against another instance or after restart",
                "server_error",
                "server_shutting_down",
            )
        if len(self.tickets) >= self.capacity:
            msg = (
                f"the server is at capacity ({self.capacity} requests in flight or queued); retry after a "
                "short wait, or start the server with a larger --max-queue"
            )
            raise ServerError(429, msg, "rate_limit_error", "queue_full")
        ticket = Ticket()
        self.tickets.add(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        self.tickets.discard(ticket)
        if not self.tickets and self._idle is not None:
            self._idle.set()

    @property
    def waiting(self) -> int:
        return sum(1 for t in self.tickets if t.waiting())

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is admitted; False if some still are after ``timeout`` seconds."""
        if not self.tickets:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


# -- streaming -----------------------------------------------------------------------------------

_END = object()


class StreamBridge:
    """Runs an engine stream on its own thread and queues its items for the event loop.

    The engine's stream is a plain iterator whose steps block (prefill, decode); a
    dedicated thread per stream keeps those steps off the loop and out of the
    small default executor. ``cancel`` is checked before each item is handed
    over, and closing the iterator ends the generation at that token.
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
        self.cancel = threading.Event()
        self.started = False
        """True once the first item (a delta or the result) is out."""
        self._on_exit = on_exit
        self.thread = threading.Thread(target=self._pump, name="kvboost-stream", daemon=True)

    def start(self) -> None:
        self.thread.start()

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
        except BaseException as e:  # handed to the loop, which reports it in the stream
            self._hand_over(e)
        finally:
            try:
                close = getattr(self.steps, "close", None)
                if close is not None:
                    close()  # a generator left half-way stops here, releasing what it holds
            finally:
                self._hand_over(_END)
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
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# -- metrics middleware --------------------------------------------------------------------------


class MetricsMiddleware:
    """Counts every HTTP exchange by endpoint and status, and times it to its last byte."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = (
            path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        )
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


# -- the service ---------------------------------------------------------------------------------


class Service:
    """State of one app: the engine, admission, metrics, live streams, and the request paths."""

    def __init__(
        self,
        engine: KVBoostEngine,
        *,
        model_name: str,
        max_queue: int,
        request_timeout_s: float,
        default_max_tokens: int,
        shutdown_grace_s: float,
        close_engine: bool,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.default_max_tokens = default_max_tokens
        self.shutdown_grace_s = shutdown_grace_s
        self.close_engine = close_engine
        self.admission = Admission(max_queue)
        self.metrics = ServerMetrics(model_name, max_queue)
        self.bridges: set[StreamBridge] = set()
        self.created = int(time.time())
        namespace = getattr(engine, "namespace", None)
        self.fingerprint = f"kv-{namespace[:16]}" if isinstance(namespace, str) else None
        self._closed = False

    def begin_drain(self) -> None:
        """Admit nothing more (health turns 503); requests already admitted carry on."""
        self.admission.draining = True

    async def shutdown(self) -> None:
        """Drain (bounded by the grace period), stop what is left, then close the engine (which flushes
        the store)."""
        if self._closed:
            return
        self._closed = True
        self.begin_drain()
        if not await self.admission.wait_idle(self.shutdown_grace_s):
            logger.warning(
                "%d requests still running after %.0f s; cancelling them",
                len(self.admission.tickets),
                self.shutdown_grace_s,
            )
            for ticket in list(self.admission.tickets):
                ticket.cancel()
        for bridge in list(self.bridges):
            bridge.cancel.set()
            await asyncio.to_thread(bridge.thread.join, 10.0)  # a stream thread stops at its next token
        if self.close_engine:
            await asyncio.to_thread(self.engine.close)

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self,
        request: Request,
        kind: Literal["chat", "completion"],
        prompt: Any,
        kwargs: dict[str, Any],
        *,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        try:
            ticket = self.admission.admit()
        except ServerError as e:  # 429 at capacity, 503 while draining
            return error_response(e)
        shaper = Shaper(kind, self.model_name, self.fingerprint)
        handed_over = False  # a stream keeps its ticket until its response ends
        try:
            if stream:
                response = await self._start_stream(
                    request, ticket, shaper, prompt, kwargs, include_usage, deadline
                )
                handed_over = True
                return response
            return await self._complete(request, ticket, shaper, prompt, kwargs, deadline)
        except ContextWindowExceededError as e:
            param = "messages" if kind == "chat" else "prompt"
            return error_response(BadRequest(str(e), param, "context_length_exceeded"))
        except Exception as e:
            return error_response(e)
        finally:
            if not handed_over:
                self.admission.release(ticket)

    async def _complete(
        self,
        request: Request,
        ticket: Ticket,
        shaper: Shaper,
        prompt: Any,
        kwargs: dict[str, Any],
        deadline: float,
    ) -> Response:
        try:
            future = self.engine.submit(EngineRequest(prompt, **kwargs))
        except RuntimeError as e:  # the engine is closed
            raise ServerError(503, f"{e}", "server_error", "server_shutting_down") from e
        ticket.waiting = lambda: not (future.running() or future.done())
        ticket.cancel = future.cancel
        result_ready = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            timeout = max(deadline - asyncio.get_running_loop().time(), 0.0)
            done, _ = await asyncio.wait(
                {result_ready, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if result_ready in done:
                result = (
                    result_ready.result()
                )  # bad input raises here (the engine validates in its scheduler)
                self.metrics.record_result(result)
                return JSONResponse(shaper.response(result))
            if gone in done:
                return Response(status_code=499)  # nobody to answer; 499 is the usual "client closed" count
            raise ServerError(504, self._timeout_message(), "timeout_error", "request_timeout")
        finally:
            gone.cancel()
            result_ready.cancel()  # no-op once done; else nobody waits for the outcome any more
            if not future.done():
                # timeout, disconnect or shutdown: the request leaves its batch at the next token
                future.cancel()

    def _timeout_message(self) -> str:
        return (
            f"the request did not finish within {self.request_timeout_s:g} s and was stopped; ask for fewer "
            "tokens (max_tokens), retry when the server is less busy, or raise --request-timeout-s"
        )

    async def _start_stream(
        self,
        request: Request,
        ticket: Ticket,
        shaper: Shaper,
        prompt: Any,
        kwargs: dict[str, Any],
        include_usage: bool,
        deadline: float,
    ) -> Response:
        # Validation and tokenization run here, so bad input is still a plain 400 (no stream has started).
        steps = await asyncio.to_thread(self.engine.stream, prompt, **kwargs)
        loop = asyncio.get_running_loop()
        bridge = StreamBridge(steps, loop, self.bridges.discard)
        ticket.waiting = lambda: not bridge.started
        ticket.cancel = bridge.cancel.set
        endpoint = str(request.url.path)
        outcome: dict[str, bool] = {"finished": False}

        def on_close() -> None:
            bridge.cancel.set()
            if not outcome["finished"]:
                self.metrics.record_stream_abort(endpoint, "disconnect")
            self.admission.release(ticket)

        async def events() -> AsyncIterator[bytes]:
            self.bridges.add(bridge)
            bridge.start()
            if shaper.kind == "chat":
                yield sse(shaper.chunk(role=True, with_usage_field=include_usage))
            while True:
                try:
                    item = await asyncio.wait_for(bridge.queue.get(), max(deadline - loop.time(), 0.0))
                except TimeoutError:
                    bridge.cancel.set()
                    outcome["finished"] = True
                    self.metrics.record_stream_abort(endpoint, "timeout")
                    yield sse(error_body(self._timeout_message(), "timeout_error", None, "request_timeout"))
                    yield sse("[DONE]")
                    return
                if isinstance(item, BaseException) or item is _END:
                    outcome["finished"] = True
                    self.metrics.record_stream_abort(endpoint, "error")
                    error = (
                        item if isinstance(item, BaseException) else RuntimeError("the stream ended early")
                    )
                    yield sse(_error_payload(error))
                    yield sse("[DONE]")
                    return
                if item.text:
                    yield sse(shaper.chunk(item.text, with_usage_field=include_usage))
                if item.result is not None:
                    outcome["finished"] = True
                    self.metrics.record_result(item.result)
                    last = shaper.chunk(
                        finish_reason=item.result.finish_reason, with_usage_field=include_usage
                    )
                    last["kvboost"] = item.result.reuse_report()
                    yield sse(last)
                    if include_usage:
                        yield sse(shaper.usage_chunk(item.result))
                    yield sse("[DONE]")
                    return

        return EventStream(events(), on_close)


def _error_payload(exc: BaseException) -> dict[str, Any]:
    """The error event of a stream that fails after it started (same body as a non-streamed error)."""
    return json.loads(error_response(exc).body)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the app -------------------------------------------------------------------------------------


def create_app(
    engine: KVBoostEngine,
    *,
    model_name: str | None = None,
    max_queue: int = 64,
    request_timeout_s: float = 120.0,
    default_max_tokens: int = 256,
    shutdown_grace_s: float = 30.0,
    close_engine: bool = True,
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
    app.state.kvboost = service
    app.add_middleware(MetricsMiddleware, metrics=service.metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(*_validation_message(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"{detail}: this server offers {', '.join(ENDPOINTS)}"
        return JSONResponse(
            error_body(detail, "invalid_request_error", None, code), status_code=exc.status_code
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            messages = chat_messages(body)
            kwargs = sampling_kwargs(
                body,
                max_tokens=body.max_completion_tokens or body.max_tokens,
                default_max_tokens=service.default_max_tokens,
            )
        except InvalidRequestError as e:
            return error_response(e)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await service.generate(
            request, "chat", messages, kwargs, stream=bool(body.stream), include_usage=include_usage
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            prompt = completion_prompt(body)
            kwargs = sampling_kwargs(
                body, max_tokens=body.max_tokens, default_max_tokens=service.default_max_tokens
            )
        except InvalidRequestError as e:
            return error_response(e)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await service.generate(
            request, "completion", prompt, kwargs, stream=bool(body.stream), include_usage=include_usage
        )

    def model_card() -> dict[str, Any]:
        return {
            "id": service.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": "kvboost-rag",
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != service.model_name:
            msg = f"model {model_id!r} is not served here; this server serves {service.model_name!r}"
            return JSONResponse(
                error_body(msg, "invalid_request_error", "model", "model_not_found"), status_code=404
            )
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> JSONResponse:
        a = service.admission
        body = {
            "status": "shutting_down" if a.draining else "ok",
            "model": service.model_name,
            "in_flight": len(a.tickets),
            "queue_depth": a.waiting,
            "max_queue": a.capacity,
        }
        return JSONResponse(body, status_code=503 if a.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        store = None
        if not service._closed:
            try:  # the disk tier counts its entries in SQLite: off the loop
                store = await asyncio.to_thread(service.engine.stats)
            except Exception:  # metrics must not fail because a tier cannot be read right now
                logger.warning("engine.stats() failed; /metrics leaves the store families out", exc_info=True)
        a = service.admission
        text = service.metrics.render(
            in_flight=len(a.tickets), waiting=a.waiting, draining=a.draining, store=store
        )
        return Response(text, media_type=CONTENT_TYPE)

    return app


def _validation_message(errors: Any) -> tuple[str, str, str | None, None]:
    """(message, type, param, code) for pydantic's first complaint about a request body."""
    first = errors[0] if errors else {}
    # a union reports the alternative that failed (`str`, `list[str]`); the caller needs the field only
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_branch(str(part))]
    if first.get("type") == "json_invalid":
        return (
            "the request body is not valid JSON; send a JSON object with Content-Type: application/json",
            "invalid_request_error",
            None,
            None,
        )
    param = ""
    for part in loc:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    problem = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"{param} is required; add it to the request body"
    else:
        got = repr(first.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."  # the whole body can be the input
        message = f"{param or 'the request body'}: {problem} (got {got})"
    return message, "invalid_request_error", param or None, None


def _is_union_branch(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list") or "[" in part


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
        # uvicorn waits this long for open responses, then cancels them; the app's own shutdown follows
        timeout_graceful_shutdown=service.shutdown_grace_s,
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
    ``request_timeout_s``, ``default_max_tokens``, ``shutdown_grace_s``).
    """
    app = create_app(engine, **app_options)
    create_server(app, host=host, port=port, log_level=log_level).run()
