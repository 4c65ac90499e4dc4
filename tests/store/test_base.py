"""Store interface: thread-safe counters, and what every local tier offers (remove, clear, tiers, records)."""

import threading
from collections.abc import Callable

import pytest
import torch

from kvboost_rag.store import DiskStore, KVStore, MemoryStore, StoredChunk, TieredStore
from kvboost_rag.store.base import TierCounters


def test_counters_add_fields_and_extras_and_snapshots_are_copies():
    c = TierCounters(extra=["corrupt"])
    c.read(found=True)
    c.read(found=False)
    c.add("puts", 3)
    c.add("evictions", 2)
    c.add("corrupt")
    c.add("late")  # an extra that was not declared up front
    s = c.snapshot()
    assert (s.hits, s.misses, s.puts, s.evictions) == (1, 1, 3, 2)
    assert s.extra == {"corrupt": 1, "late": 1}
    s.extra["corrupt"] = 99
    s.hits = 99
    again = c.snapshot()
    assert again.extra["corrupt"] == 1 and again.hits == 1


def test_counters_lose_nothing_across_threads():
    c = TierCounters()

    def bump() -> None:
        for _ in range(2000):
            c.read(found=True)
            c.add("skipped")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.snapshot()
    assert s.hits == 8000 and s.extra["skipped"] == 8000


# -- the interface, on every local tier --------------------------------------------------


def _chunk(seed: int = 0) -> StoredChunk:
    g = torch.Generator().manual_seed(seed)
    return StoredChunk(torch.randn(1, 2, 1, 4, 8, generator=g))


@pytest.fixture(params=["memory", "disk", "tiered"])
def store(request, tmp_path):
    made: dict[str, Callable[[], KVStore]] = {
        "memory": lambda: MemoryStore(1 << 20),
        "disk": lambda: DiskStore(tmp_path / "store", namespace="ns", background_writes=False),
        "tiered": lambda: TieredStore([MemoryStore(1 << 20), DiskStore(tmp_path / "store", namespace="ns")]),
    }
    s = made[request.param]()
    yield s
    s.close()


def test_remove_deletes_one_entry_and_says_whether_it_was_there(store):
    store.put("a", _chunk(1))
    store.put("b", _chunk(2))
    store.flush()
    assert store.remove("a") is True
    assert store.remove("a") is False
    assert store.remove("never") is False
    assert not store.contains("a") and store.get("a") is None
    assert store.contains("b") and store.get("b") is not None


def test_clear_deletes_every_entry_and_keeps_the_counters(store):
    for i in range(3):
        store.put(f"k{i}", _chunk(i), pin=i == 0)  # pinned entries go too
    store.flush()
    assert store.get("k1") is not None
    store.clear()
    assert not any(store.contains(f"k{i}") for i in range(3))
    stats = store.stats()
    for name, s in stats.items():
        assert (s.entries, s.bytes, s.pinned) == (0, 0, 0), name
        assert s.puts == 3, name
    assert sum(s.hits for s in stats.values()) == 1
    store.put("k0", _chunk(0))  # and the tier is usable after
    store.flush()
    assert store.get("k0") is not None


def test_tiers_and_shared_records_need_no_probing(store):
    tiers = store.tiers
    assert [t.name for t in tiers] == (["memory", "disk"] if store.name == "tiered" else [store.name])
    assert all(isinstance(t, KVStore) for t in tiers)
    tiers.clear()  # a copy: the store keeps its tiers
    assert store.tiers
    assert store.shared_records() is None  # only the Redis tier shares registry records
