"""The background writer: writes are zero-argument callables; order, flush, bounds, failures, waiting
for CPU prefills, and closing write-behind tiers once."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import pytest

from kvboost_rag import busy
from kvboost_rag.store import writer as writer_module
from kvboost_rag.store.writer import BackgroundWriter, WriteBehindTier, prefill_in_progress


def test_writes_run_in_order_and_flush_waits():
    done = []
    w = BackgroundWriter(name="t")
    for i in range(5):
        assert w.submit(lambda i=i: (time.sleep(0.01), done.append(i)))
    w.flush()
    assert done == [0, 1, 2, 3, 4]
    w.close()


def test_a_write_is_any_zero_argument_callable():
    class Op:
        def __init__(self, log: list[str]) -> None:
            self.log = log

        def __call__(self) -> None:
            self.log.append("op object")

    done: list[str] = []
    w = BackgroundWriter(name="t")
    w.submit(partial(done.append, "partial"))
    w.submit(Op(done))
    w.submit(lambda: done.append("lambda") or 42)  # a result is ignored
    w.close()
    assert done == ["partial", "op object", "lambda"]


def test_synchronous_mode_runs_at_once():
    done = []
    w = BackgroundWriter(name="t", background=False)
    w.submit(partial(done.append, "a"))
    assert done == ["a"] and not w.background


def test_bounds_refuse_instead_of_blocking():
    release = threading.Event()
    wait = partial(release.wait, 5)
    w = BackgroundWriter(name="t", max_items=1, max_bytes=100)
    assert w.submit(wait, 10)  # taken by the thread, which blocks on it
    time.sleep(0.05)
    assert w.submit(wait, 10)  # queued
    assert not w.submit(wait, 10)  # over the item bound
    release.set()
    w.flush()
    big = BackgroundWriter(name="t", max_bytes=100)
    release.clear()
    assert big.submit(wait, 1000)  # one write is always taken, however big
    assert not big.submit(wait, 1)
    release.set()
    big.close()
    w.close()


def test_a_failing_write_is_logged_and_the_thread_goes_on(caplog):
    done = []

    def bad() -> None:
        raise OSError("disk said no")

    w = BackgroundWriter(name="t")
    with caplog.at_level(logging.ERROR):
        w.submit(bad)
        w.submit(partial(done.append, "good"))
        w.flush()
    assert done == ["good"] and "disk said no" in caplog.text
    w.close()


def test_writes_wait_for_a_prefill_then_run(monkeypatch):
    monkeypatch.setattr(writer_module, "MAX_WRITE_DELAY_S", 5.0)
    done = []
    w = BackgroundWriter(name="t")
    with prefill_in_progress():
        w.submit(partial(done.append, "x"))
        time.sleep(0.1)
        assert done == []  # held while the prefill runs
    w.flush()
    assert done == ["x"]
    w.close()


def test_a_long_prefill_delays_writes_by_a_bounded_time(monkeypatch):
    monkeypatch.setattr(writer_module, "MAX_WRITE_DELAY_S", 0.1)
    done = []
    w = BackgroundWriter(name="t")
    with prefill_in_progress():
        w.submit(partial(done.append, "x"))
        t0 = time.perf_counter()
        w.flush()  # the writer gives up waiting: no deadlock with a flush inside a prefill
        assert done == ["x"] and time.perf_counter() - t0 < 2
    w.close()


@pytest.mark.parametrize("raises", [False, True])
def test_the_prefill_gate_opens_after_an_error(raises):
    try:
        with prefill_in_progress():
            assert busy.prefills_in_progress() == 1
            if raises:
                raise RuntimeError
    except RuntimeError:
        pass
    assert busy.prefills_in_progress() == 0
    assert busy.wait_until_idle(timeout=0.0)


def test_the_gate_lives_in_the_bottom_layer():
    """The runner imports it from kvboost_rag.busy; the writer's name is the same object."""
    assert writer_module.prefill_in_progress is busy.prefill_in_progress


class _Tier(WriteBehindTier):
    """A write-behind tier that keeps nothing: enough to see flush and close at work."""

    name = "test"

    def __init__(self) -> None:
        self.written: list[str] = []
        self.released = 0
        self._start_writer("t", background=True)

    def put(self, key, chunk, *, cost=1.0, pin=False):
        self._writer.submit(partial(self.written.append, key))

    def _release(self) -> None:
        self.released += 1

    def get(self, key):
        return None

    def contains(self, key):
        return False

    def pin(self, key, pinned=True):
        return False

    def remove(self, key):
        return False

    def clear(self):
        pass

    def stats(self):
        return {}


def test_a_write_behind_tier_flushes_and_releases_once():
    tier = _Tier()
    tier.put("a", None)
    tier.flush()
    assert tier.written == ["a"]
    tier.put("b", None)
    tier.close()
    tier.close()
    assert tier.written == ["a", "b"] and tier.released == 1
    assert tier not in busy._AT_EXIT["stores"]  # nothing left to close at exit
