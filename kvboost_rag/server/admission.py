"""The admission gate: a bounded number of generation requests, and none once shutdown begins.

Every generation request holds one :class:`Ticket` from arrival to its last byte. At most
``capacity`` tickets are out at once, in flight or waiting for the model; the next request
is refused with 429 (and with 503 while the server drains) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .errors import ServerError


class Ticket:
    """One admitted generation request.

    The request path fills in ``waiting`` and ``cancel`` once it knows how its work runs
    (a scheduler future or a stream thread).
    """

    def __init__(self) -> None:
        self.waiting: Callable[[], bool] = lambda: True
        """Whether the request has not started generating yet (for the queue-depth gauge)."""
        self.cancel: Callable[[], object] = lambda: None
        """Stops the request's work (at its next token); what it returns is ignored."""


class Admission:
    """At most ``capacity`` requests admitted at once, in flight or waiting; nothing while draining.

    Used from the event loop only, so plain counters suffice.

    >>> gate = Admission(1)
    >>> ticket = gate.admit()
    >>> gate.admit()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    kvboost_rag.server.errors.ServerError: the server is at capacity (1 requests in flight or queued); ...
    >>> gate.release(ticket)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        """The most tickets out at once."""
        self.tickets: set[Ticket] = set()
        """Tickets admitted and not yet released."""
        self.draining = False
        """Set when shutdown begins: nothing more is admitted."""
        self._idle: asyncio.Event | None = None

    def admit(self) -> Ticket:
        """A ticket for one more request; raises :class:`ServerError` (429 full, 503 draining)."""
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
        """Give ``ticket`` back (idempotent); wakes :meth:`wait_idle` when it was the last one."""
        self.tickets.discard(ticket)
        if not self.tickets and self._idle is not None:
            self._idle.set()

    @property
    def waiting(self) -> int:
        """Admitted requests that have not started generating."""
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
