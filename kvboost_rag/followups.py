"""Background work that follows an answer: one thread, run in order, never on a request's path.

After a chat answer is returned, the engine stores the reply as the next turn will
render it (see ``EngineConfig.store_replies``). That work waits here so the caller
gets its answer first, and runs only while no request is in progress (requests mark
themselves with :meth:`FollowUps.activity`): on a CPU it would slow them down. A job
that finds no idle moment within ``MAX_IDLE_WAIT_S`` is dropped, as is a failing one:
it only costs reuse (the next turn then computes the reply itself).
:meth:`FollowUps.join` waits for the queue (tests, benchmarks, shutdown).

>>> jobs = FollowUps()
>>> done = []
>>> jobs.submit(lambda: done.append(1))
True
>>> jobs.join(); done
[1]
>>> jobs.close()
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .busy import close_at_exit, run_queue

logger = logging.getLogger(__name__)

MAX_PENDING = 64
"""Queued jobs beyond this are dropped (a burst of chat answers outruns the background)."""

MAX_IDLE_WAIT_S = 5.0
"""Longest a job waits for an idle moment; past it, it is dropped."""

IDLE_GRACE_S = 0.25
"""How long no request must have been in progress before a job starts: an agent loop's next
call usually comes sooner, and then already holds the reply itself."""


class FollowUps:
    def __init__(self, name: str = "kvboost-followups") -> None:
        self._name = name
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(MAX_PENDING)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._active = 0
        close_at_exit(self, "work")  # running jobs end before the interpreter tears down (they use torch)

    @contextmanager
    def activity(self) -> Iterator[None]:
        """Mark a request in progress: jobs wait until none is."""
        with self._idle:
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; False when the queue is full or closed (the job is dropped)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                logger.debug("follow-up queue full; a job was dropped")
                return False
        return True

    def join(self) -> None:
        """Wait until every queued job has run."""
        self._queue.join()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _wait_for_idle(self) -> bool:
        """Wait until no request has been in progress for ``IDLE_GRACE_S``; False after
        ``MAX_IDLE_WAIT_S``."""
        deadline = time.monotonic() + MAX_IDLE_WAIT_S
        with self._idle:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._idle.wait_for(lambda: not self._active, timeout=left):
                    return False
                if not self._idle.wait_for(lambda: self._active, timeout=min(IDLE_GRACE_S, left)):
                    return True  # still idle after the grace period

    def _work(self) -> None:
        run_queue(self._queue, self._run, "a background follow-up")  # a failure only costs reuse

    def _run(self, job: Callable[[], None]) -> None:
        if self._wait_for_idle():
            job()
        else:
            logger.debug("no idle moment for a follow-up job; dropped")
