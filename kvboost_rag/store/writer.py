"""Write-behind for slow tiers: writes run on one background thread so generation never waits on them.

The disk and Redis tiers queue their writes here. ``flush()`` waits for what is queued;
``close()`` flushes and stops the thread. Tiers that are still open when the interpreter
exits are closed then, so queued writes are not lost at a normal exit.

On a CPU the writer shares the cores with the model: encoding and writing a chunk while a
prefill runs stalls the prefill's worker threads (measured: the cold path at 2-4K tokens
went from ~1.0x to ~0.83x the speed of plain prefill on 2 cores). So writers wait while a
CPU prefill is in progress (:func:`prefill_in_progress`), for at most ``MAX_WRITE_DELAY_S``.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


MAX_WRITE_DELAY_S = 2.0
"""Longest a queued write waits for prefills to finish; past it, it is written anyway."""

_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_busy = 0  # CPU prefills in progress in this process
_idle = threading.Condition()


@contextmanager
def prefill_in_progress() -> Iterator[None]:
    """Background writes wait until this block (and every other one in progress) ends."""
    global _busy
    with _idle:
        _busy += 1
    try:
        yield
    finally:
        with _idle:
            _busy -= 1
            if not _busy:
                _idle.notify_all()


def _wait_for_idle_cores() -> None:
    with _idle:
        _idle.wait_for(lambda: not _busy, timeout=MAX_WRITE_DELAY_S)


@atexit.register
def _close_open_tiers() -> None:
    for tier in list(_OPEN):
        tier.close()


def close_at_exit(tier: _Closable) -> None:
    """Close ``tier`` (flushing its writes) when the interpreter exits, unless it was closed before."""
    _OPEN.add(tier)


def closed(tier: _Closable) -> None:
    """``tier`` was closed: nothing is left to do at exit."""
    _OPEN.discard(tier)


class BackgroundWriter:
    """Applies queued items on a daemon thread, in order; synchronously when ``background`` is False.

    ``max_items`` and ``max_bytes`` bound what waits (0 / None: unbounded); :meth:`submit`
    refuses an item beyond them rather than block the caller. An exception from ``apply``
    is logged and never stops the thread.

    >>> done = []
    >>> writer = BackgroundWriter(done.append, name="example")
    >>> writer.submit("a"), writer.submit("b")
    (True, True)
    >>> writer.close(); done
    ['a', 'b']
    """

    def __init__(
        self,
        apply: Callable[[Any], None],
        *,
        name: str,
        background: bool = True,
        max_items: int = 0,
        max_bytes: int | None = None,
    ) -> None:
        self._apply = apply
        self._name = name
        self.max_bytes = max_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Any, int] | None] = queue.Queue(maxsize=max_items)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    @property
    def background(self) -> bool:
        return self._thread is not None

    def submit(self, item: Any, nbytes: int = 0) -> bool:
        """Queue ``item`` (``nbytes`` counts against ``max_bytes``); False when the queue is full."""
        if self._thread is None:
            self._run(item)
            return True
        with self._lock:
            # One item is always taken, however big, so a huge write is not refused forever.
            if self.max_bytes is not None and self._pending_bytes and self._pending_bytes + nbytes > self.max_bytes:
                return False
            self._pending_bytes += nbytes
        try:
            self._queue.put_nowait((item, nbytes))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= nbytes
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued item has been applied."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            entry = self._queue.get()
            try:
                if entry is None:
                    return
                _wait_for_idle_cores()
                self._run(entry[0])
            finally:
                if entry is not None:
                    with self._lock:
                        self._pending_bytes -= entry[1]
                self._queue.task_done()

    def _run(self, item: Any) -> None:
        try:
            self._apply(item)
        except Exception:  # a failed cache write must never take the writer (or a request) down
            logger.exception("%s: a background write failed", self._name)
