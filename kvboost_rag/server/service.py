"""The state of one app and its request paths: admit, generate (whole or streamed), drain, shut down.

Concurrency model: the event loop never runs model code. Every request is handed to
the engine's batching scheduler (``engine.submit``, or ``engine.astream`` for streams), so
concurrent requests, streamed or not, share batches; a stream's deltas reach the loop by
callback as its tokens come out (:class:`~kvboost_rag.async_stream.ScheduledFeed`). Every generation
request holds one admission ticket from arrival to its last byte.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..async_stream import END, AsyncStream
from ..engine import KVBoostEngine
from ..errors import ContextWindowExceededError
from ..request import Request
from .admission import Admission, Ticket
from .errors import ServerError, error_payload, error_response
from .metrics import ServerMetrics
from .protocol import BadRequest, Shaper, error_body, sse
from .streaming import EventStream

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
"""Which endpoint a request came from: it shapes the response bodies."""

STOP_SHARE = 0.25
"""Share of the shutdown grace period kept for stopping what still runs and closing the engine
(at most ``MAX_STOP_S``): open requests get the rest."""

MAX_STOP_S = 5.0
"""At most this much of the grace period is kept for stopping (a stop takes one layer's work)."""


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
        self.admission = Admission(max_queue)
        self.metrics = ServerMetrics(model_name, max_queue)
        self.engine = engine
        self.model_name = model_name
        """What ``/v1/models`` lists and every response reports."""
        self.request_timeout_s = request_timeout_s
        self.default_max_tokens = default_max_tokens
        self.shutdown_grace_s = shutdown_grace_s
        self.close_engine = close_engine
        self._streams: set[AsyncStream] = set()
        self.created = int(time.time())
        namespace = getattr(engine, "namespace", None)
        self.fingerprint = f"kv-{namespace[:16]}" if isinstance(namespace, str) else None
        self._closed = False
        self._drain_started: float | None = None  # time.monotonic() when draining began

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` has begun (the engine may be closed)."""
        return self._closed

    @property
    def stop_s(self) -> float:
        """Seconds at the end of the grace period kept for stopping what still runs and closing
        the engine."""
        return min(self.shutdown_grace_s * STOP_SHARE, MAX_STOP_S)

    def begin_drain(self) -> None:
        """Admit nothing more (health turns 503); requests already admitted carry on."""
        self.admission.draining = True
        if self._drain_started is None:
            self._drain_started = time.monotonic()

    async def shutdown(self) -> None:
        """Drain, stop what is left, then close the engine (which flushes the store), all within the
        grace period counted from when draining began.

        Admitted requests may finish until :attr:`stop_s` before its end; then every request
        still running is cancelled (it stops at its next layer or token, a long prefill too)
        and the engine closed. Whatever has not stopped by the end of the period is left to
        the process exit (the model's threads are daemons; queued store writes are flushed at exit).
        """
        if self._closed:
            return
        self._closed = True
        self.begin_drain()
        assert self._drain_started is not None
        end = self._drain_started + self.shutdown_grace_s
        if not await self.admission.wait_idle(max(end - self.stop_s - time.monotonic(), 0.0)):
            logger.warning(
                "%d requests still running with %.1f s of the %.0f s grace period left; cancelling them",
                len(self.admission.tickets),
                self.stop_s,
                self.shutdown_grace_s,
            )
            for ticket in list(self.admission.tickets):
                ticket.cancel()
        feeds = [stream.feed for stream in self.running_streams if stream.feed is not None]
        for feed in feeds:
            feed.stop()
        for feed in feeds:  # a stopped stream ends at its next layer or token
            await asyncio.to_thread(feed.wait_done, max(end - time.monotonic(), 0.0))
        if self.close_engine:
            # On a daemon thread: a close that outlives the grace period cannot hold the process.
            closing = threading.Thread(target=self.engine.close, name="kvboost-close", daemon=True)
            closing.start()
            await asyncio.to_thread(closing.join, max(end - time.monotonic(), 0.0))
            if closing.is_alive():
                logger.warning("the engine did not close within the grace period; exiting without waiting")

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self,
        http: HTTPRequest,
        kind: Kind,
        request: Request,
        *,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        """Serve ``request``: a JSON response, or with ``stream`` a server-sent event stream.

        Errors become OpenAI-shaped responses: 429/503 when not admitted, 400 for bad input,
        504 past the request timeout, 499 when the client went away first.
        """
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        try:
            ticket = self.admission.admit()
        except ServerError as e:  # 429 at capacity, 503 while draining
            return error_response(e)
        shaper = Shaper(kind, self.model_name, self.fingerprint)
        handed_over = False  # a stream keeps its ticket until its response ends
        try:
            if stream:
                response = await self._start_stream(http, ticket, shaper, request, include_usage, deadline)
                handed_over = True
                return response
            return await self._complete(http, ticket, shaper, request, deadline)
        except ContextWindowExceededError as e:
            param = "messages" if kind == "chat" else "prompt"
            return error_response(BadRequest(str(e), param, "context_length_exceeded"))
        except Exception as e:  # noqa: BLE001 - every failure is answered (and a bug logged) by error_response
            return error_response(e)
        finally:
            if not handed_over:
                self.admission.release(ticket)

    async def _complete(
        self, http: HTTPRequest, ticket: Ticket, shaper: Shaper, request: Request, deadline: float
    ) -> Response:
        try:
            future = self.engine.submit(request)
        except RuntimeError as e:  # the engine is closed
            raise ServerError(503, f"{e}", "server_error", "server_shutting_down") from e
        ticket.waiting = lambda: not (future.running() or future.done())
        ticket.cancel = future.cancel
        result_ready = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_client_gone(http))
        try:
            timeout = max(deadline - asyncio.get_running_loop().time(), 0.0)
            waiters: set[asyncio.Future[Any]] = {result_ready, gone}
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if result_ready in done:
                result = result_ready.result()  # a prompt the engine refuses (too long, empty) raises here
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

    @property
    def running_streams(self) -> list[AsyncStream]:
        """Streams whose generation has not ended (a stopped one ends at its next layer or token)."""
        self._streams = {s for s in self._streams if s.feed is not None and not s.feed.done}
        return list(self._streams)

    async def _start_stream(
        self,
        http: HTTPRequest,
        ticket: Ticket,
        shaper: Shaper,
        request: Request,
        include_usage: bool,
        deadline: float,
    ) -> Response:
        # Validation and tokenization run here, so bad input is still a plain 400 (no stream has started).
        stream = self.engine.astream(request)
        await stream.start()
        feed = stream.feed
        assert feed is not None
        loop = asyncio.get_running_loop()
        self._streams.add(stream)
        ticket.waiting = lambda: not feed.started
        ticket.cancel = feed.stop
        endpoint = str(http.url.path)
        outcome = {"finished": False}

        def on_close() -> None:
            feed.stop()  # no effect on a stream that ended
            if not outcome["finished"]:
                self.metrics.record_stream_abort(endpoint, "disconnect")
            self.admission.release(ticket)

        async def events() -> AsyncIterator[bytes]:
            if shaper.kind == "chat":
                yield sse(shaper.chunk(role=True, with_usage_field=include_usage))
            while True:
                try:
                    item = await asyncio.wait_for(feed.queue.get(), max(deadline - loop.time(), 0.0))
                except TimeoutError:
                    feed.stop()
                    outcome["finished"] = True
                    self.metrics.record_stream_abort(endpoint, "timeout")
                    yield sse(error_body(self._timeout_message(), "timeout_error", None, "request_timeout"))
                    yield sse("[DONE]")
                    return
                if isinstance(item, BaseException) or item is END:
                    outcome["finished"] = True
                    self.metrics.record_stream_abort(endpoint, "error")
                    error = (
                        item if isinstance(item, BaseException) else RuntimeError("the stream ended early")
                    )
                    yield sse(error_payload(error))
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


async def _client_gone(http: HTTPRequest) -> None:
    """Returns when the client disconnects (the request body has been read by then)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
