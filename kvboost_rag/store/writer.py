"""Write-behind for slow tiers: writes run on one background thread so generation never waits on them.

The disk and Redis tiers queue their writes here as zero-argument callables (usually a
``functools.partial`` of a tier method), so the writer needs no knowledge of what a write is.
``flush()`` waits for what is queued; ``close()`` flushes and stops the thread. Tiers that are
still open when the interpreter exits are closed then, so queued writes are not lost at a
normal exit.

Writers wait while a CPU prefill is in progress (:func:`kvboost_rag.busy.prefill_in_progress`),
for at most ``MAX_WRITE_DELAY_S``: on a CPU a write competes with the prefill for the cores.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import abstractmethod
from collections.abc import Callable

from ..busy import close_at_exit, forget_at_exit, prefill_in_progress, run_queue, wait_until_idle
from .base import KVStore

__all__ = ["MAX_WRITE_DELAY_S", "BackgroundWriter", "WriteBehindTier", "WriteOp", "prefill_in_progress"]

logger = logging.getLogger(__name__)

MAX_WRITE_DELAY_S = 2.0
"""Longest a queued write waits for prefills to finish; past it, it is written anyway."""

WriteOp = Callable[[], object]
"""A queued write: calling it performs the write (its result is ignored)."""


class BackgroundWriter:
    """Runs queued writes on a daemon thread, in order; at once, in the caller, when ``background`` is False.

    ``max_items`` and ``max_bytes`` bound what waits (0 / None: unbounded); :meth:`submit`
    refuses a write beyond them rather than block the caller. An exception from a write
    is logged and never stops the thread.

    >>> done = []
    >>> writer = BackgroundWriter(name="example")
    >>> writer.submit(lambda: done.append("a")), writer.submit(lambda: done.append("b"))
    (True, True)
    >>> writer.close(); done
    ['a', 'b']
    """

    def __init__(
        self,
        *,
        name: str,
        background: bool = True,
        max_items: int = 0,
        max_bytes: int | None = None,
    ) -> None:
        self._name = name
        self.max_bytes = max_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[WriteOp, int] | None] = queue.Queue(maxsize=max_items)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    @property
    def background(self) -> bool:
        return self._thread is not None

    def submit(self, op: WriteOp, nbytes: int = 0) -> bool:
        """Queue the write ``op`` (``nbytes`` counts against ``max_bytes``); False when the queue is full."""
        if self._thread is None:
            self._run(op)
            return True
        with self._lock:
            # One write is always taken, however big, so a huge write is not refused forever.
            if (
                self.max_bytes is not None
                and self._pending_bytes
                and self._pending_bytes + nbytes > self.max_bytes
            ):
                return False
            self._pending_bytes += nbytes
        try:
            self._queue.put_nowait((op, nbytes))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= nbytes
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued write has run."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        run_queue(self._queue, self._write, f"{self._name}: a background write")

    def _write(self, entry: tuple[WriteOp, int]) -> None:
        op, nbytes = entry
        try:
            wait_until_idle(timeout=MAX_WRITE_DELAY_S)
            self._run(op)
        finally:
            with self._lock:
                self._pending_bytes -= nbytes

    def _run(self, op: WriteOp) -> None:
        try:
            op()
        except Exception:  # a failed cache write must never take the writer (or a request) down
            logger.exception("%s: a write failed", self._name)


class WriteBehindTier(KVStore):
    """A tier whose writes run on a :class:`BackgroundWriter`.

    :meth:`flush` waits for them; :meth:`close` (at most once, and at interpreter exit for a
    tier still open) flushes, then :meth:`_release` lets the tier go of its files or sockets.
    """

    _writer: BackgroundWriter
    _closed: bool

    def _start_writer(
        self, name: str, *, background: bool, max_items: int = 0, max_bytes: int | None = None
    ) -> None:
        """Start the tier's writer; call it last in ``__init__``, once the tier can take writes."""
        self._writer = BackgroundWriter(
            name=name, background=background, max_items=max_items, max_bytes=max_bytes
        )
        self._closed = False
        close_at_exit(self, "stores")

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._release()
        forget_at_exit(self)

    @abstractmethod
    def _release(self) -> None:
        """Release the tier's files or connections; every queued write has run by then."""
