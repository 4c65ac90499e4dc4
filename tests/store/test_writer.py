"""The background writer: order, flush, bounds, failures, and waiting for CPU prefills."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvboost_rag.store import writer as writer_module
from kvboost_rag.store.writer import BackgroundWriter, prefill_in_progress


def test_items_are_applied_in_order_and_flush_waits():
    done = []
    w = BackgroundWriter(lambda item: (time.sleep(0.01), done.append(item)), name="t")
    for i in range(5):
        assert w.submit(i)
    w.flush()
    assert done == [0, 1, 2, 3, 4]
    w.close()


def test_synchronous_mode_applies_at_once():
    done = []
    w = BackgroundWriter(done.append, name="t", background=False)
    w.submit("a")
    assert done == ["a"] and not w.background


def test_bounds_refuse_instead_of_blocking():
    release = threading.Event()
    w = BackgroundWriter(lambda item: release.wait(5), name="t", max_items=1, max_bytes=100)
    assert w.submit("first", 10)  # taken by the thread, which blocks on it
    time.sleep(0.05)
    assert w.submit("queued", 10)
    assert not w.submit("over the item bound", 10)
    release.set()
    w.flush()
    big = BackgroundWriter(lambda item: release.wait(5), name="t", max_bytes=100)
    release.clear()
    assert big.submit("huge", 1000)  # one item is always taken, however big
    assert not big.submit("more", 1)
    release.set()
    big.close()
    w.close()


def test_a_failing_write_is_logged_and_the_thread_goes_on(caplog):
    done = []

    def apply(item):
        if item == "bad":
            raise OSError("disk said no")
        done.append(item)

    w = BackgroundWriter(apply, name="t")
    with caplog.at_level(logging.ERROR):
        w.submit("bad")
        w.submit("good")
        w.flush()
    assert done == ["good"] and "disk said no" in caplog.text
    w.close()


def test_writes_wait_for_a_prefill_then_run(monkeypatch):
    monkeypatch.setattr(writer_module, "MAX_WRITE_DELAY_S", 5.0)
    done = []
    w = BackgroundWriter(done.append, name="t")
    with prefill_in_progress():
        w.submit("x")
        time.sleep(0.1)
        assert done == []  # held while the prefill runs
    w.flush()
    assert done == ["x"]
    w.close()


def test_a_long_prefill_delays_writes_by_a_bounded_time(monkeypatch):
    monkeypatch.setattr(writer_module, "MAX_WRITE_DELAY_S", 0.1)
    done = []
    w = BackgroundWriter(done.append, name="t")
    with prefill_in_progress():
        w.submit("x")
        t0 = time.perf_counter()
        w.flush()  # the writer gives up waiting: no deadlock with a flush inside a prefill
        assert done == ["x"] and time.perf_counter() - t0 < 2
    w.close()


@pytest.mark.parametrize("raises", [False, True])
def test_the_prefill_gate_opens_after_an_error(raises):
    try:
        with prefill_in_progress():
            if raises:
                raise RuntimeError
    except RuntimeError:
        pass
    assert writer_module._busy == 0
