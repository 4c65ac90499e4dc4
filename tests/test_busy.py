"""Background work: waiting for prefills, and closing what is still open at exit in stage order."""

from __future__ import annotations

import subprocess
import sys
import threading

from kvboost_rag import busy


def test_wait_until_idle_waits_for_every_prefill_in_progress():
    # background work of earlier tests (a chat reply being stored) may still be running: let it end
    assert busy.wait_until_idle(timeout=120)
    entered, release = threading.Event(), threading.Event()

    def prefill() -> None:
        with busy.prefill_in_progress():
            entered.set()
            release.wait()

    worker = threading.Thread(target=prefill)
    worker.start()
    entered.wait()
    assert busy.prefills_in_progress() >= 1
    assert not busy.wait_until_idle(timeout=0.05)
    release.set()
    worker.join()
    assert busy.wait_until_idle(timeout=120) and busy.prefills_in_progress() == 0


def test_exit_closes_work_before_stores_and_skips_forgotten_ones():
    script = """
from kvboost_rag import busy

class Named:
    def __init__(self, name):
        self.name = name
    def close(self):
        print(self.name, flush=True)

keep = [Named("store"), Named("job"), Named("gone")]
busy.close_at_exit(keep[0], "stores")
busy.close_at_exit(keep[1], "work")
busy.close_at_exit(keep[2], "stores")
busy.forget_at_exit(keep[2])
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["job", "store"]


def test_a_collected_object_is_not_kept_alive_for_exit():
    class Job:
        def close(self) -> None:
            raise AssertionError("closed after it was collected")

    job = Job()
    busy.close_at_exit(job, "work")
    del job  # CPython frees it at once, and the weak set forgets it
    assert all(not isinstance(item, Job) for item in busy._AT_EXIT["work"])
