"""Background follow-up jobs: in order, only while no request is in progress, never fatal."""

from __future__ import annotations

import time

from kvboost_rag import followups
from kvboost_rag.followups import FollowUps


def test_jobs_wait_for_requests_to_finish():
    jobs = FollowUps()
    ran_at = []
    with jobs.activity():
        jobs.submit(lambda: ran_at.append(time.perf_counter()))
        time.sleep(0.2)
        assert not ran_at  # a request is in progress
        ended = time.perf_counter()
    jobs.join()
    assert ran_at and ran_at[0] >= ended
    jobs.close()


def test_a_job_with_no_idle_moment_is_dropped(monkeypatch):
    monkeypatch.setattr(followups, "MAX_IDLE_WAIT_S", 0.1)
    jobs = FollowUps()
    ran = []
    with jobs.activity():
        jobs.submit(lambda: ran.append(1))
        jobs.join()  # the job gave up waiting while the request was still in progress
    assert ran == []
    jobs.close()


def test_a_failing_job_does_not_stop_the_next(caplog):
    jobs = FollowUps()
    ran = []
    jobs.submit(lambda: 1 / 0)
    jobs.submit(lambda: ran.append(1))
    jobs.join()
    assert ran == [1] and "follow-up failed" in caplog.text
    jobs.close()
