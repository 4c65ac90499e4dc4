"""Memory tier: byte budget, GDSF eviction, pinning, stats, thread safety."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.memory import MemoryStore

UNIT = 64 * 4  # bytes of chunk(4): [1, 2, 1, 4, 8] float32


def chunk(tokens=4, fill=0.0, logits=False):
    """A StoredChunk of ``64 * tokens`` bytes (plus 40 bytes of logits when asked)."""
    kv = torch.full((1, 2, 1, tokens, 8), fill)
    return StoredChunk(kv, torch.zeros(10) if logits else None)


def memory_stats(store):
    return store.stats()["memory"]


def assert_accounting(store, sizes):
    """Bytes reported == sum of the sizes of the keys still present, within budget unless pinned."""
    present = [k for k in sizes if store.contains(k)]
    s = memory_stats(store)
    assert s.bytes == sum(sizes[k] for k in present)
    assert s.entries == len(present) == len(store)


# -- basic operations --------------------------------------------------------


def test_put_get_contains():
    store = MemoryStore(max_bytes=10 * UNIT)
    c = chunk(fill=1.5)
    assert not store.contains("a")
    assert store.get("a") is None
    store.put("a", c)
    assert store.contains("a")
    hit = store.get("a")
    assert hit.tier == "memory"
    assert hit.chunk is c
    assert torch.equal(hit.chunk.kv, torch.full((1, 2, 1, 4, 8), 1.5))


def test_chunk_sizes():
    assert chunk(4).nbytes == UNIT
    assert chunk(4).num_tokens == 4
    assert chunk(4, logits=True).nbytes == UNIT + 40


def test_remove():
    store = MemoryStore(max_bytes=10 * UNIT)
    store.put("a", chunk())
    store.put("b", chunk(8))
    assert store.remove("a") is True
    assert store.remove("a") is False
    assert not store.contains("a") and store.contains("b")
    assert memory_stats(store).bytes == 2 * UNIT
    assert memory_stats(store).entries == 1


def test_clear():
    store = MemoryStore(max_bytes=10 * UNIT)
    for k in "abc":
        store.put(k, chunk())
    store.clear()
    assert len(store) == 0
    s = memory_stats(store)
    assert s.bytes == 0 and s.entries == 0
    assert store.get("a") is None
    # still usable after clear
    store.put("d", chunk())
    assert store.contains("d") and memory_stats(store).bytes == UNIT


def test_replacing_a_key_keeps_bytes_right():
    store = MemoryStore(max_bytes=10 * UNIT)
    store.put("a", chunk(4))
    store.put("a", chunk(12, fill=2.0))
    s = memory_stats(store)
    assert s.entries == 1 and s.bytes == 3 * UNIT
    assert store.get("a").chunk.num_tokens == 12
    store.put("a", chunk(4, logits=True))
    assert memory_stats(store).bytes == UNIT + 40
    store.remove("a")
    assert memory_stats(store).bytes == 0


def test_replacing_keys_under_pressure_keeps_accounting():
    store = MemoryStore(max_bytes=5 * UNIT)
    rng = random.Random(0)
    sizes = {}
    for _ in range(300):
        k = f"k{rng.randrange(8)}"
        tokens = 4 * rng.randint(1, 3)
        store.put(k, chunk(tokens))
        sizes[k] = tokens * 64
        assert memory_stats(store).bytes <= store.max_bytes
        assert_accounting(store, sizes)


# -- budget and eviction ------------------------------------------------------


def test_budget_is_never_exceeded():
    store = MemoryStore(max_bytes=7 * UNIT)
    rng = random.Random(1)
    sizes = {}
    for i in range(200):
        tokens = 4 * rng.randint(1, 4)
        store.put(f"k{i}", chunk(tokens), cost=rng.uniform(0.5, 5))
        sizes[f"k{i}"] = tokens * 64
        if rng.random() < 0.5:
            store.get(f"k{rng.randrange(i + 1)}")
        assert memory_stats(store).bytes <= store.max_bytes
        assert_accounting(store, sizes)
    s = memory_stats(store)
    assert s.puts == 200
    assert s.evictions == 200 - s.entries


def test_eviction_counter():
    store = MemoryStore(max_bytes=3 * UNIT)
    for k in "abc":
        store.put(k, chunk())
    assert memory_stats(store).evictions == 0
    store.put("d", chunk())
    assert memory_stats(store).evictions == 1
    assert len(store) == 3
    store.put("e", chunk(8))  # needs two units
    assert memory_stats(store).evictions == 3
    assert memory_stats(store).bytes == 3 * UNIT


def test_entry_larger_than_the_budget_is_not_stored():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("small", chunk())
    store.put("big", chunk(12))
    assert not store.contains("big")
    assert store.contains("small")  # nothing was evicted for it
    s = memory_stats(store)
    assert s.bytes == UNIT and s.evictions == 0 and s.puts == 1


def test_entry_exactly_the_budget_is_stored():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("whole", chunk(8))
    assert store.contains("whole")
    assert memory_stats(store).bytes == 2 * UNIT


def test_new_entry_displaces_older_ones_at_cost_proportional_to_tokens():
    # the engine passes cost ~ tokens, so cost per byte is the same for every chunk
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("a", chunk(4), cost=4.0)
    store.put("whole", chunk(8), cost=8.0)
    assert store.contains("whole") and not store.contains("a")
    assert memory_stats(store).bytes == 2 * UNIT


def test_frequently_read_entry_survives():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("hot", chunk())
    store.put("cold", chunk())
    for _ in range(3):
        assert store.get("hot") is not None
    store.put("new", chunk())
    assert store.contains("hot")
    assert not store.contains("cold")
    assert store.contains("new")


def test_frequency_wins_even_when_the_hot_entry_is_older():
    store = MemoryStore(max_bytes=3 * UNIT)
    store.put("hot", chunk())
    store.get("hot")
    store.get("hot")
    store.put("a", chunk())
    store.put("b", chunk())
    store.put("c", chunk())  # evicts one of the never-read ones, the oldest first
    assert store.contains("hot")
    assert not store.contains("a")


def test_higher_cost_entry_survives():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("cheap", chunk(), cost=1.0)
    store.put("dear", chunk(), cost=100.0)
    store.put("new", chunk(), cost=10.0)
    assert store.contains("dear")
    assert not store.contains("cheap")


def test_higher_cost_survives_even_when_put_first():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("dear", chunk(), cost=100.0)
    store.put("cheap", chunk(), cost=1.0)
    store.put("new", chunk(), cost=1.0)
    assert store.contains("dear")
    assert not store.contains("cheap")


def test_smaller_entry_survives_at_equal_cost():
    store = MemoryStore(max_bytes=3 * UNIT)
    store.put("large", chunk(8))
    store.put("small", chunk(4))
    store.put("new", chunk(4))  # over by one unit: the low cost-per-byte entry goes
    assert store.contains("small") and store.contains("new")
    assert not store.contains("large")


def test_unused_entries_age_out():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("once-hot", chunk())
    store.get("once-hot")
    for i in range(6):
        store.put(f"n{i}", chunk())
    assert not store.contains("once-hot")


# -- pinning -----------------------------------------------------------------


def test_pinned_entries_are_never_evicted():
    store = MemoryStore(max_bytes=3 * UNIT)
    store.put("pinned", chunk(), pin=True)
    for i in range(30):
        store.put(f"k{i}", chunk(), cost=1000.0)
        assert store.contains("pinned")
        assert memory_stats(store).bytes <= store.max_bytes
    assert memory_stats(store).pinned == 1


def test_pin_method_protects_an_existing_entry():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("a", chunk())
    assert store.pin("a") is True
    assert store.pin("missing") is False
    for i in range(10):
        store.put(f"k{i}", chunk(), cost=50.0)
    assert store.contains("a")


def test_pinned_entries_can_exceed_the_budget():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("p1", chunk(), pin=True)
    store.put("p2", chunk(), pin=True)
    store.put("p3", chunk(), pin=True)
    s = memory_stats(store)
    assert s.entries == 3 and s.pinned == 3 and s.bytes == 3 * UNIT
    store.put("free", chunk())
    assert not store.contains("free")
    assert all(store.contains(k) for k in ("p1", "p2", "p3"))


def test_pinned_entry_larger_than_the_budget_is_stored():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("small", chunk())
    store.put("big", chunk(12), pin=True)
    assert store.contains("big")
    assert not store.contains("small")
    assert memory_stats(store).bytes == 3 * UNIT


def test_unpinned_entry_becomes_evictable():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("big", chunk(12), pin=True)
    assert store.pin("big", False) is True
    # over budget once unpinned: evicted at once
    assert not store.contains("big")
    s = memory_stats(store)
    assert s.bytes == 0 and s.evictions == 1 and s.pinned == 0


def test_unpinned_entry_is_evicted_by_later_puts():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("p", chunk(), pin=True)
    for i in range(5):
        store.put(f"k{i}", chunk())
    assert store.contains("p")
    store.pin("p", False)
    for i in range(5, 12):
        store.put(f"k{i}", chunk())
    assert not store.contains("p")
    assert memory_stats(store).bytes <= store.max_bytes


def test_replacing_a_pinned_key_keeps_the_pin():
    store = MemoryStore(max_bytes=2 * UNIT)
    store.put("p", chunk(), pin=True)
    store.put("p", chunk(fill=3.0))
    assert memory_stats(store).pinned == 1
    for i in range(6):
        store.put(f"k{i}", chunk())
    assert store.contains("p")
    assert store.get("p").chunk.kv[0, 0, 0, 0, 0] == 3.0


# -- stats -------------------------------------------------------------------


def test_stats_numbers():
    store = MemoryStore(max_bytes=3 * UNIT)
    store.put("a", chunk())
    store.put("b", chunk(4, logits=True), pin=True)
    store.get("a")
    store.get("a")
    store.get("b")
    store.get("nope")
    s = memory_stats(store)
    assert (s.hits, s.misses, s.puts, s.evictions) == (3, 1, 2, 0)
    assert s.entries == 2
    assert s.bytes == 2 * UNIT + 40
    assert s.pinned == 1
    assert s.hit_rate == pytest.approx(0.75)
    assert list(store.stats()) == ["memory"]


def test_stats_are_a_snapshot():
    store = MemoryStore(max_bytes=3 * UNIT)
    before = memory_stats(store)
    store.put("a", chunk())
    store.get("a")
    assert (before.hits, before.puts, before.entries, before.bytes) == (0, 0, 0, 0)
    assert before.hit_rate == 0.0


def test_contains_does_not_count_as_a_read():
    store = MemoryStore(max_bytes=3 * UNIT)
    store.put("a", chunk())
    store.contains("a")
    store.contains("b")
    s = memory_stats(store)
    assert s.hits == 0 and s.misses == 0


# -- threads -----------------------------------------------------------------


def test_concurrent_puts_and_gets_keep_accounting_consistent():
    store = MemoryStore(max_bytes=20 * UNIT)
    n_threads, n_ops = 8, 400
    gets = [0] * n_threads
    errors = []
    barrier = threading.Barrier(n_threads)

    def worker(t):
        rng = random.Random(t)
        try:
            barrier.wait()
            for _ in range(n_ops):
                k = f"k{rng.randrange(64)}"
                if rng.random() < 0.5:
                    store.put(k, chunk(4 * (int(k[1:]) % 3 + 1)), cost=rng.uniform(1, 3), pin=False)
                else:
                    store.get(k)
                    gets[t] += 1
                if rng.random() < 0.05:
                    store.remove(f"k{rng.randrange(64)}")
        except Exception as e:  # noqa: BLE001  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    sizes = {f"k{i}": 64 * 4 * (i % 3 + 1) for i in range(64)}
    assert_accounting(store, sizes)
    s = memory_stats(store)
    assert s.bytes <= store.max_bytes
    assert s.hits + s.misses == sum(gets)


def test_repeated_hits_do_not_grow_memory():
    import tracemalloc

    store = MemoryStore(max_bytes=10 * UNIT)
    store.put("a", chunk())
    store.get("a")
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(20_000):
            store.get("a")
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 200_000, f"{grown} bytes kept for 20000 hits on one entry"
