"""Circuit breaker and rate-limited warnings, shared by the Redis and disk tiers."""

from __future__ import annotations

import logging

import pytest

from kvboost_rag.store import resilience
from kvboost_rag.store.resilience import CircuitBreaker, RateLimitedWarnings

LOGGER = logging.getLogger("kvboost_rag.tests.resilience")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(resilience.time, "monotonic", c)
    return c


def test_the_breaker_pauses_after_a_failure_and_doubles_up_to_the_cap(clock):
    breaker = CircuitBreaker(backoff_s=1.0, max_backoff_s=5.0)
    assert breaker.allow()
    assert [breaker.failure() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert not breaker.allow()
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()


def test_a_success_resets_the_pause(clock):
    breaker = CircuitBreaker(backoff_s=1.0, max_backoff_s=30.0)
    breaker.failure()
    breaker.failure()
    breaker.success()
    assert breaker.failure() == 1.0


def test_one_warning_per_kind_per_period_with_the_count_held_back(clock, caplog):
    warnings = RateLimitedWarnings(LOGGER, every_s=30.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        warnings.warn("error", "failed (%s)", "first")
        warnings.warn("error", "failed (%s)", "second")
        warnings.warn("error", "failed (%s)", "third")
        warnings.warn("queue", "queue full")  # another kind has its own period
        clock.now += 31
        warnings.warn("error", "failed (%s)", "fourth")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "failed (first)",
        "queue full",
        "failed (fourth) (2 similar warnings in the last 30 s not shown)",
    ]
    assert all(r.name == LOGGER.name for r in caplog.records)  # the tier's own logger


def test_a_zero_period_logs_every_warning(clock, caplog):
    warnings = RateLimitedWarnings(LOGGER, every_s=0.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        for i in range(3):
            warnings.unusable_entry("disk", f"{i}" * 20, "checksum mismatch")
    assert len(caplog.records) == 3
    assert caplog.records[0].getMessage() == (
        "disk tier entry 000000000000… is unusable (checksum mismatch); removed, it will be recomputed"
    )
