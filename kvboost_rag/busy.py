"""Background work beside the requests: it keeps off the cores while a CPU prefill runs, and it is
finished when the interpreter exits.

A bottom-layer module (of the package it imports only :mod:`kvboost_rag.openmp`): the runner
marks its prefills with :func:`prefill_in_progress`, and background writers
(:mod:`kvboost_rag.store.writer`) call :func:`wait_until_idle` before each write. Both those
writers and the engine's follow-up jobs register with :func:`close_at_exit`; their threads give
their OpenMP workers back whenever their queue runs dry (:func:`run_queue`).

On a CPU the background work shares the cores with the model: encoding and writing a chunk while
a prefill runs stalls the prefill's worker threads (measured: the cold path at 2-4K tokens went
from ~1.0x to ~0.83x the speed of plain prefill on 2 cores).

>>> with prefill_in_progress():
...     prefills_in_progress() >= 1  # and any other thread's in progress
True
>>> wait_until_idle(timeout=0.1)
True
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, Protocol, TypeVar

from .openmp import release_pool

logger = logging.getLogger(__name__)

T = TypeVar("T")

_busy = 0  # prefills in progress in this process
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


def prefills_in_progress() -> int:
    """How many :func:`prefill_in_progress` blocks are open now, in every thread."""
    with _idle:
        return _busy


def wait_until_idle(timeout: float) -> bool:
    """Block until no prefill is in progress, or for at most ``timeout`` seconds; True when idle."""
    with _idle:
        return _idle.wait_for(lambda: not _busy, timeout=timeout)


def run_queue(items: queue.Queue[T | None], handle: Callable[[T], object], what: str) -> None:
    """A worker thread's loop: ``handle`` each item in order until a None arrives.

    An exception from ``handle`` is logged as ``"<what> failed"`` and never stops the loop
    (background work must not take the thread, or a request, down).
    """
    while True:
        if items.empty():  # idle until the next item: its OpenMP workers would slow the threads that compute
            release_pool()
        item = items.get()
        try:
            if item is None:
                return
            handle(item)
        except Exception:
            logger.exception("%s failed", what)
        finally:
            items.task_done()


class Closable(Protocol):
    def close(self) -> None: ...


ExitStage = Literal["work", "stores"]
"""``work`` (jobs that may still write to stores) is closed first, then ``stores`` (their writers)."""

_AT_EXIT: dict[ExitStage, weakref.WeakSet[Closable]] = {
    "work": weakref.WeakSet(),
    "stores": weakref.WeakSet(),
}


def close_at_exit(closable: Closable, stage: ExitStage) -> None:
    """Close ``closable`` when the interpreter exits (if still alive), so queued work is not lost."""
    _AT_EXIT[stage].add(closable)


def forget_at_exit(closable: Closable) -> None:
    """Undo :func:`close_at_exit` (a closed object has nothing left to finish)."""
    for group in _AT_EXIT.values():
        group.discard(closable)


@atexit.register
def _close_all() -> None:
    for group in _AT_EXIT.values():  # in stage order
        for closable in list(group):
            closable.close()
