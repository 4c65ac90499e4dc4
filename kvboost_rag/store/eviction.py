"""Which entries a tier evicts first: one policy, shared by the memory and disk tiers.

An entry's *value* is ``hits * cost / bytes``: entries read often (frequency) that are
expensive to recompute (cost) and small (size) are kept over large, cheap, cold ones.
Recency enters in one of two ways, depending on what the tier can keep:

- **In one process** (memory tier): GreedyDual-Size-Frequency. An entry's priority is
  ``clock + value``, set when it is stored or read; the lowest goes first and the clock
  rises to the evicted priority, so entries that are not read again fall behind the ones
  that are (:class:`GreedyDualQueue`).
- **Across processes** (disk tier): there is no shared clock, so the value decays with the
  time since the last read, halved after ``recency_half_life_s`` (:meth:`EvictionPolicy.score`).

Pinned entries are never evicted; the tiers leave them out.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

RECENCY_HALF_LIFE_S = 3600.0
"""Time since the last read at which a disk entry's score is halved."""


class Candidate(NamedTuple):
    """What the policy weighs about one evictable entry."""

    key: str
    nbytes: int
    hits: int
    cost: float
    last_access: float
    """Time of the last read or write (``time.time()``)."""


@dataclass(frozen=True)
class EvictionPolicy:
    """Scores entries by size, recompute cost, frequency and recency; the lowest goes first.

    >>> policy = EvictionPolicy()
    >>> policy.value(hits=2, cost=100.0, nbytes=50)
    4.0
    >>> policy.score(hits=2, cost=100.0, nbytes=50, age_s=policy.recency_half_life_s)
    2.0
    >>> policy.choose_victims([Candidate("cold", 50, 1, 100.0, 0.0), Candidate("hot", 50, 9, 100.0, 0.0)],
    ...                       free_bytes=10, now=0.0)
    ['cold']
    """

    recency_half_life_s: float = RECENCY_HALF_LIFE_S

    def value(self, *, hits: int, cost: float, nbytes: int) -> float:
        """Frequency times recompute cost per byte kept."""
        return hits * cost / max(nbytes, 1)

    def priority(self, clock: float, *, hits: int, cost: float, nbytes: int) -> float:
        """GreedyDual priority of an entry stored or read when the queue's clock stood at ``clock``."""
        return clock + self.value(hits=hits, cost=cost, nbytes=nbytes)

    def score(self, *, hits: int, cost: float, nbytes: int, age_s: float) -> float:
        """The value, decayed by the time since the last read (for tiers without a shared clock)."""
        return self.value(hits=hits, cost=cost, nbytes=nbytes) / (1.0 + age_s / self.recency_half_life_s)

    def choose_victims(self, candidates: Iterable[Candidate], *, free_bytes: int, now: float) -> list[str]:
        """Keys to evict, lowest :meth:`score` first, until they add up to ``free_bytes``."""

        def score(c: Candidate) -> float:
            return self.score(hits=c.hits, cost=c.cost, nbytes=c.nbytes, age_s=now - c.last_access)

        victims: list[str] = []
        for candidate in sorted(candidates, key=score):
            if free_bytes <= 0:
                break
            victims.append(candidate.key)
            free_bytes -= candidate.nbytes
        return victims


class GreedyDualQueue:
    """The in-process eviction order of a tier's entries (GreedyDual-Size-Frequency).

    Not thread-safe: the tier calls it under its own lock.

    >>> queue = GreedyDualQueue(EvictionPolicy())
    >>> queue.touch("a", hits=1, cost=1.0, nbytes=10)
    >>> queue.touch("b", hits=5, cost=1.0, nbytes=10)
    >>> queue.pop(), queue.clock
    ('a', 0.1)
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.clock = 0.0
        """Priority of the last entry evicted: what an entry read now starts from."""
        self._heap: list[tuple[float, int, str]] = []  # (priority, version, key); stale items are skipped
        self._live: dict[str, tuple[float, int]] = {}  # key -> (priority, version) of its current item
        self._versions = itertools.count()

    def touch(self, key: str, *, hits: int, cost: float, nbytes: int) -> None:
        """(Re)place ``key`` at the priority it has now: after a put, a read or an unpin."""
        priority = self.policy.priority(self.clock, hits=hits, cost=cost, nbytes=nbytes)
        version = next(self._versions)
        self._live[key] = (priority, version)
        heapq.heappush(self._heap, (priority, version, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            # Every touch leaves a stale item behind; rebuild before they pile up.
            self._heap = [(p, v, k) for k, (p, v) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, key: str) -> None:
        """Forget ``key`` (removed from the tier)."""
        self._live.pop(key, None)

    def pop(self, evictable: Callable[[str], bool] = lambda key: True) -> str | None:
        """Take the lowest-priority evictable key out of the queue and raise the clock to its priority.

        Keys that are not ``evictable`` (pinned) leave the queue without moving the clock; the
        tier touches them again when they become evictable. None when nothing is left.
        """
        while self._heap:
            priority, version, key = heapq.heappop(self._heap)
            if self._live.get(key, (None, None))[1] != version:
                continue  # stale: the key was touched again or discarded since
            del self._live[key]
            if evictable(key):
                self.clock = priority
                return key
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()
