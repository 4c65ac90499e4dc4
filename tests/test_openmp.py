"""OpenMP worker pools: a thread that stops computing ends its workers, and the scheduler's worker
does so whenever its queue runs dry."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from kvboost_rag.openmp import release_pool
from kvboost_rag.scheduler import Arrivals, Pending, Scheduler

pytestmark = pytest.mark.skipif(
    not release_pool() or torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"),
    reason="needs GNU libgomp, two or more threads for PyTorch, and /proc",
)


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _parallel_kernel() -> None:
    torch.ones(1 << 22).sum()  # well past the grain size: runs on the thread's OpenMP pool


def test_release_pool_ends_the_calling_threads_workers() -> None:
    seen: dict[str, set[str]] = {}

    def work() -> None:
        seen["before"] = _tasks()
        _parallel_kernel()
        seen["pool"] = _tasks() - seen["before"]
        release_pool()
        seen["after"] = _tasks()
        _parallel_kernel()  # a new pool starts where one is needed again
        release_pool()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["pool"], "the parallel kernel started no worker thread"
    assert not seen["pool"] & seen["after"]


def test_the_scheduler_worker_ends_its_pool_when_idle() -> None:
    pool: set[str] = set()

    def serve(batch: Sequence[Pending[str]], arrivals: Arrivals[str]) -> None:
        before = _tasks()
        _parallel_kernel()
        pool.update(_tasks() - before)
        for pending in batch:
            pending.future.settle(pending.request)

    scheduler: Scheduler[str] = Scheduler(serve, window_s=0, max_batch_size=1)
    try:
        assert scheduler.submit("a").result(timeout=60) == "a"
        assert pool, "the parallel kernel started no worker thread"
        deadline = time.monotonic() + 30
        while pool & _tasks() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pool & _tasks()
    finally:
        scheduler.close()
