"""What lets a failing tier cost little: a circuit breaker, and warnings that cannot flood the log.

A tier is a cache: when its backend fails or returns garbage, a read is a miss and a write is
dropped, and the request goes on. These pieces keep such failures cheap and visible:

- :class:`CircuitBreaker` skips a backend for a while after a failure (doubling while
  failures repeat), so a dead server costs one timeout per period instead of one per chunk.
- :class:`RateLimitedWarnings` logs one line per kind of problem per period, with a count of
  the lines it held back, so a failing backend under load does not bury everything else.
- :class:`ForeignEntries` keeps a shared store whole under mixed secrets: an entry this process
  cannot trust is a miss here, but left in place (and not overwritten) for those that can.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import TierCounters


class CircuitBreaker:
    """Skip a backend for a while after a failure; the pause doubles while failures repeat.

    >>> breaker = CircuitBreaker(backoff_s=60.0, max_backoff_s=300.0)
    >>> breaker.allow()
    True
    >>> breaker.failure(), breaker.allow()
    (60.0, False)
    >>> breaker.failure()  # failing again (a try after the pause): twice as long
    120.0
    """

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._failures = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether the backend may be tried now (no pause in progress)."""
        return time.monotonic() >= self._open_until

    def success(self) -> None:
        """A call went through: the next failure pauses for ``backoff_s`` again."""
        if self._failures:
            with self._lock:
                self._failures = 0

    def failure(self) -> float:
        """Record a failure; returns the pause that starts now."""
        with self._lock:
            self._failures += 1
            pause = min(self.backoff_s * 2 ** (self._failures - 1), self.max_backoff_s)
            self._open_until = time.monotonic() + pause
            return pause


class RateLimitedWarnings:
    """One log line per kind of problem every ``every_s`` seconds, with a count of those held back.

    Lines go to ``logger`` (the tier's own, so they can be filtered by tier).
    """

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg % args`` unless a line of this ``kind`` went out less than ``every_s`` ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -float("inf")) < self.every_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += " (%d similar warnings in the last %.0f s not shown)"
            args = (*args, held, self.every_s)
        self.logger.warning(msg, *args)

    def unusable_entry(self, tier: str, key: str, reason: str) -> None:
        """The warning for an entry that failed its checks and was removed (a miss, recomputed)."""
        self.warn(
            "corrupt",
            "%s tier entry %s… is unusable (%s); removed, it will be recomputed",
            tier,
            key[:12],
            reason,
        )


class ForeignEntries:
    """Entries a tier read intact but signed otherwise than it signs (another store secret, or
    signed where it has none, unsigned where it has one): each read is a miss, counted as
    ``foreign``; one warning per reason names the fix; the entry stays for the processes that
    signed it, and this tier does not overwrite it with its own copy (those processes would then
    find theirs foreign in turn). Eviction by size and age still removes it in time.

    >>> from kvboost_rag.store.base import TierCounters
    >>> counters = TierCounters(extra=["foreign"])
    >>> foreign = ForeignEntries(logging.getLogger("example"), "disk", counters)
    >>> foreign.seen("k1", "signed under another store secret")
    >>> "k1" in foreign, "k2" in foreign, counters.snapshot().extra["foreign"]
    (True, False, 1)
    """

    MAX_KEYS = 1 << 16
    """Keys remembered (not to overwrite); the oldest are forgotten beyond it."""

    def __init__(self, logger: logging.Logger, tier: str, counters: TierCounters) -> None:
        self._logger, self._tier, self._counters = logger, tier, counters
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def seen(self, key: str, reason: str) -> None:
        """A read found ``key`` foreign for ``reason``."""
        self._counters.add("foreign")
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self.MAX_KEYS:
                self._keys.popitem(last=False)
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            self._logger.warning(
                "%s tier holds entries %s; they are misses for this process and stay for the processes "
                "that wrote them: give every process the same store secret (KVBOOST_STORE_SECRET, "
                "EngineConfig.store_secret), or list the old one in store_previous_secrets while "
                "rotating; 'kvboost-rag gc --foreign' removes them",
                self._tier,
                reason,
            )

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys
