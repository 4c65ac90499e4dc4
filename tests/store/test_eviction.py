"""Eviction policy: scores by size, cost, frequency and recency; the GreedyDual queue; both tiers use it."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.disk import DiskStore
from kvboost_rag.store.eviction import Candidate, EvictionPolicy, GreedyDualQueue
from kvboost_rag.store.memory import MemoryStore

POLICY = EvictionPolicy(recency_half_life_s=100.0)


def candidate(
    key: str, nbytes: int = 100, hits: int = 1, cost: float = 10.0, last_access: float = 0.0
) -> Candidate:
    return Candidate(key, nbytes, hits, cost, last_access)


# -- scores ------------------------------------------------------------------------------


def test_value_rises_with_hits_and_cost_and_falls_with_size():
    base = POLICY.value(hits=1, cost=10.0, nbytes=100)
    assert POLICY.value(hits=2, cost=10.0, nbytes=100) == 2 * base
    assert POLICY.value(hits=1, cost=20.0, nbytes=100) == 2 * base
    assert POLICY.value(hits=1, cost=10.0, nbytes=200) == base / 2
    assert POLICY.value(hits=1, cost=10.0, nbytes=0) == 10.0  # an empty entry does not divide by zero


def test_priority_is_the_clock_plus_the_value():
    assert POLICY.priority(5.0, hits=2, cost=10.0, nbytes=100) == 5.0 + 0.2


def test_score_halves_after_the_half_life():
    fresh = POLICY.score(hits=1, cost=10.0, nbytes=100, age_s=0.0)
    assert POLICY.score(hits=1, cost=10.0, nbytes=100, age_s=100.0) == fresh / 2
    assert POLICY.score(hits=1, cost=10.0, nbytes=100, age_s=300.0) == fresh / 4


@pytest.mark.parametrize(
    ("kept", "evicted"),
    [
        (candidate("small", nbytes=50), candidate("large", nbytes=500)),
        (candidate("costly", cost=100.0), candidate("cheap", cost=1.0)),
        (candidate("often", hits=10), candidate("once", hits=1)),
        (candidate("recent", last_access=1000.0), candidate("old", last_access=0.0)),
    ],
    ids=["size", "cost", "frequency", "recency"],
)
def test_choose_victims_takes_the_lowest_score_first(kept, evicted):
    for order in ([kept, evicted], [evicted, kept]):
        assert POLICY.choose_victims(order, free_bytes=1, now=1000.0) == [evicted.key]


def test_choose_victims_stops_once_enough_bytes_are_freed():
    candidates = [candidate(f"k{i}", nbytes=100, hits=i + 1) for i in range(5)]
    assert POLICY.choose_victims(candidates, free_bytes=0, now=0.0) == []
    assert POLICY.choose_victims(candidates, free_bytes=100, now=0.0) == ["k0"]
    assert POLICY.choose_victims(candidates, free_bytes=101, now=0.0) == ["k0", "k1"]
    assert len(POLICY.choose_victims(candidates, free_bytes=10_000, now=0.0)) == 5


def test_the_score_matches_what_the_disk_index_held_before_it_moved_here():
    """The disk tier used to rank in SQL; the policy gives the same order for the same rows."""
    rows = [
        ("a", 100, 1, 10.0, 0.0),
        ("b", 400, 9, 50.0, 900.0),
        ("c", 50, 2, 1.0, 500.0),
        ("d", 10, 1, 3.0, 990.0),
    ]
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE entries (key TEXT, bytes INTEGER, hits INTEGER, cost REAL, last_access REAL)")
    con.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?)", rows)
    sql = "SELECT key FROM entries ORDER BY (hits * cost / MAX(bytes, 1)) / (1.0 + (? - last_access) / ?) ASC"
    expected = [k for (k,) in con.execute(sql, (1000.0, POLICY.recency_half_life_s))]
    assert POLICY.choose_victims([Candidate(*r) for r in rows], free_bytes=10_000, now=1000.0) == expected


# -- the GreedyDual queue ----------------------------------------------------------------


def test_queue_pops_the_lowest_priority_and_raises_the_clock():
    queue = GreedyDualQueue(POLICY)
    queue.touch("a", hits=1, cost=10.0, nbytes=100)  # 0.1
    queue.touch("b", hits=3, cost=10.0, nbytes=100)  # 0.3
    assert queue.pop() == "a" and queue.clock == pytest.approx(0.1)
    queue.touch("c", hits=1, cost=10.0, nbytes=100)  # clock + 0.1 = 0.2: ahead of nothing but below b
    assert queue.pop() == "c" and queue.pop() == "b" and queue.pop() is None


def test_a_touch_moves_an_entry_and_leaves_no_stale_pop():
    queue = GreedyDualQueue(POLICY)
    queue.touch("a", hits=1, cost=10.0, nbytes=100)
    queue.touch("b", hits=2, cost=10.0, nbytes=100)
    queue.touch("a", hits=5, cost=10.0, nbytes=100)  # read since: now above b
    assert [queue.pop(), queue.pop(), queue.pop()] == ["b", "a", None]


def test_discarded_keys_are_never_popped():
    queue = GreedyDualQueue(POLICY)
    queue.touch("a", hits=1, cost=10.0, nbytes=100)
    queue.touch("b", hits=2, cost=10.0, nbytes=100)
    queue.discard("a")
    assert queue.pop() == "b" and queue.pop() is None


def test_keys_that_are_not_evictable_leave_the_queue_without_moving_the_clock():
    queue = GreedyDualQueue(POLICY)
    queue.touch("pinned", hits=1, cost=10.0, nbytes=100)
    queue.touch("b", hits=2, cost=10.0, nbytes=100)
    assert queue.pop(lambda key: key != "pinned") == "b"
    assert queue.clock == pytest.approx(0.2)  # b's priority, not the pinned entry's
    assert queue.pop() is None  # the pinned key left; the tier touches it again when unpinned
    queue.touch("pinned", hits=1, cost=10.0, nbytes=100)
    assert queue.pop() == "pinned"


def test_many_touches_keep_the_heap_small_and_the_order_right():
    queue = GreedyDualQueue(POLICY)
    for round_ in range(200):
        for i in range(10):
            queue.touch(f"k{i}", hits=round_ + i, cost=10.0, nbytes=100)
    assert len(queue._heap) <= 2 * 10 + 64 + 1
    assert [queue.pop() for _ in range(10)] == [f"k{i}" for i in range(10)]


# -- the tiers use it --------------------------------------------------------------------


class FirstByName(EvictionPolicy):
    """Evicts only the alphabetically first key, whatever is to be freed: shows that the tier asks it."""

    def choose_victims(self, candidates, *, free_bytes, now):
        return [min(c.key for c in candidates)]


def chunk(tokens: int = 4) -> StoredChunk:
    return StoredChunk(torch.zeros(1, 2, 1, tokens, 8))


def test_the_memory_tier_orders_by_its_policy():
    class Costly(EvictionPolicy):
        def value(self, *, hits: int, cost: float, nbytes: int) -> float:
            return -cost  # the opposite of the default: the expensive entry goes first

    one = chunk().nbytes
    store = MemoryStore(max_bytes=2 * one, policy=Costly())
    store.put("cheap", chunk(), cost=1.0)
    store.put("costly", chunk(), cost=100.0)
    store.put("new", chunk(), cost=50.0)
    assert not store.contains("costly") and store.contains("cheap")


def test_the_disk_tier_asks_its_policy_which_entries_go(tmp_path):
    store = DiskStore(tmp_path / "store", namespace="ns", background_writes=False, policy=FirstByName())
    try:
        for key in ("b", "c", "a"):
            store.put(key, chunk(), cost=1000.0)
        assert store.evict_to(1) == 1
        assert not store.contains("a") and store.contains("b") and store.contains("c")
    finally:
        store.close()
