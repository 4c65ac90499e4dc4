"""The engine as the ingress sees it: the server's :class:`~kvboost_rag.server.service.Service` runs
unchanged over it (routes, admission, limits, API keys, tenants, timeouts, streams), and every
request goes to an engine replica through a Ray Serve handle, routed by its text (:mod:`.routing`).

The service needs three things of an engine: ``submit`` (a future of the result), ``astream`` (an
:class:`~kvboost_rag.async_stream.AsyncStream` whose ``start`` raises bad input) and ``close``.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any

from ..async_stream import END, AsyncStream
from ..request import Request
from ..results import GenerationResult
from .replica import READY
from .routing import Routed

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator


def unwrapped(error: BaseException) -> BaseException:
    """The replica's own exception where Ray wrapped it (bad input stays a 400 at the ingress)."""
    from ray.exceptions import RayTaskError

    cause = error.cause if isinstance(error, RayTaskError) else None
    return cause if isinstance(cause, Exception) else error


class RemoteEngine:
    """Requests of the ingress, answered by the replicas behind ``handle``."""

    namespace = None
    """Replicas may differ in nothing that matters, but the ingress loads no model: responses carry
    no ``system_fingerprint``."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    def submit(self, request: Request) -> Future[GenerationResult]:
        """The result of ``request`` from a replica; ``cancel()`` stops it there. Called on the event
        loop."""
        loop = asyncio.get_running_loop()
        return asyncio.run_coroutine_threadsafe(self._generate(request), loop)

    async def _generate(self, request: Request) -> GenerationResult:
        try:
            result: GenerationResult = await self._handle.generate.remote(Routed.of(request))
        except Exception as e:  # noqa: BLE001 - re-raised as the replica raised it
            raise unwrapped(e) from None
        return result

    def astream(self, request: Request) -> AsyncStream:
        """The deltas of ``request`` from a replica; ``start()`` raises bad input before any delta."""
        return _RemoteStream(self._handle, request)

    def stats(self) -> None:
        """None: the store's counters live on each replica (Ray's ``kvboost_*`` metrics per replica,
        or ``stats`` on the engine deployment's handle)."""
        return None

    def close(self) -> None:
        """Nothing to close here: each replica closes its engine when Ray Serve stops it."""


class _RemoteStream(AsyncStream):
    def __init__(self, handle: DeploymentHandle, request: Request) -> None:
        super().__init__(self._unused)
        self._handle, self._request = handle, request

    @staticmethod
    def _unused(loop: asyncio.AbstractEventLoop) -> Any:
        raise AssertionError("a remote stream opens its feed in start()")

    async def start(self) -> None:
        if self.feed is None and not self._cancelled:
            response = self._handle.options(stream=True).stream.remote(Routed.of(self._request))
            feed = _RemoteFeed(response)  # type: ignore[arg-type]  # stream=True: a generator
            await feed.open()  # bad input raises here
            self.feed = feed
            if self._cancelled:
                feed.stop()


class _RemoteFeed:
    """A replica's streamed items on the ingress's loop (the :class:`~kvboost_rag.async_stream.Feed`
    the service reads)."""

    def __init__(self, response: DeploymentResponseGenerator) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._response = response
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finished = threading.Event()
        self._stopped = False
        self.started = False

    async def open(self) -> None:
        """Wait for the replica to prepare the request: its error, or :data:`READY`."""
        self._loop = asyncio.get_running_loop()
        try:
            first = await self._response.__anext__()
        except Exception as e:  # noqa: BLE001 - re-raised as the replica raised it
            self._finished.set()
            raise unwrapped(e) from None
        assert first == READY, first
        self._task = asyncio.ensure_future(self._pump())

    def start(self) -> None:
        """Nothing left to start: :meth:`open` did."""

    async def _pump(self) -> None:
        try:
            async for item in self._response:
                self.started = True
                self.queue.put_nowait(item)
        except asyncio.CancelledError:
            self.queue.put_nowait(CancelledError())
        except Exception as e:  # noqa: BLE001 - handed to the reader
            self.queue.put_nowait(unwrapped(e))
        finally:
            self.queue.put_nowait(END)
            self._finished.set()

    def stop(self) -> None:
        """Stop the request on its replica (from any thread)."""
        self._stopped = True
        if self._loop is not None and not self._finished.is_set():
            self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self._response.cancel()
        if self._task is not None:
            self._task.cancel()

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait_done(self, timeout_s: float) -> None:
        self._finished.wait(timeout_s)
