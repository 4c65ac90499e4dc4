"""Tiered store: read-through, promotion into the faster tier, puts and pins in every tier, merged stats."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.disk import DiskStore
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.tiered import TieredStore

NS = "model-a|tok|float32|v1"


def key(i) -> str:
    return f"{i:0>64}"


def chunk(tokens=4, seed=0, logits=False):
    g = torch.Generator().manual_seed(seed)
    logits_ = torch.randn(9, generator=g) if logits else None
    return StoredChunk(torch.randn(2, 2, 1, tokens, 8, generator=g), logits_)


def same(a: StoredChunk, b: StoredChunk) -> bool:
    eq = torch.equal(a.kv, b.kv) and a.kv.dtype == b.kv.dtype
    if a.last_logits is None or b.last_logits is None:
        return eq and a.last_logits is None and b.last_logits is None
    return eq and torch.equal(a.last_logits, b.last_logits)


@pytest.fixture
def tiers(tmp_path):
    memory = MemoryStore(max_bytes=1 << 20)
    disk = DiskStore(tmp_path / "store", namespace=NS)
    store = TieredStore([memory, disk])
    yield store, memory, disk
    store.close()


@pytest.fixture
def tight(tmp_path):
    """Factory: ``tight(n)`` gives tiers whose memory holds only ``n`` test chunks; closed after the test."""
    made: list[TieredStore] = []

    def make(chunks: int) -> tuple[TieredStore, MemoryStore, DiskStore]:
        memory = MemoryStore(max_bytes=chunks * chunk().nbytes)
        disk = DiskStore(tmp_path / f"store-{len(made)}", namespace=NS)
        made.append(TieredStore([memory, disk]))
        return made[-1], memory, disk

    yield make
    for store in made:
        store.close()


def test_needs_a_tier():
    with pytest.raises(ValueError):
        TieredStore([])


def test_disk_only_entry_is_served_from_disk_then_from_memory(tiers):
    store, memory, disk = tiers
    c = chunk(seed=1, logits=True)
    disk.put(key(1), c)
    disk.flush()
    assert not memory.contains(key(1))

    first = store.get(key(1))
    assert first is not None and first.tier == "disk"
    assert same(first.chunk, c)
    assert memory.contains(key(1))  # promoted

    second = store.get(key(1))
    assert second is not None and second.tier == "memory"
    assert same(second.chunk, c)
    s = store.stats()
    assert (s["disk"].hits, s["memory"].hits) == (1, 1)
    assert s["memory"].misses == 1  # the first read looked in memory first


def test_promotion_keeps_the_disk_copy(tiers):
    store, memory, disk = tiers
    disk.put(key(1), chunk(seed=2))
    disk.flush()
    store.get(key(1))
    memory.remove(key(1))
    hit = store.get(key(1))
    assert hit.tier == "disk" and same(hit.chunk, chunk(seed=2))


def test_a_miss_in_every_tier_is_none(tiers):
    store, memory, disk = tiers
    assert store.get(key(9)) is None
    s = store.stats()
    assert (s["memory"].misses, s["disk"].misses) == (1, 1)
    assert not memory.contains(key(9)) and not disk.contains(key(9))


def test_put_goes_to_both_tiers(tiers):
    store, memory, disk = tiers
    c = chunk(seed=3)
    store.put(key(1), c, cost=4.0)
    store.flush()
    assert memory.contains(key(1)) and disk.contains(key(1))
    assert same(memory.get(key(1)).chunk, c)
    assert same(disk.get(key(1)).chunk, c)
    s = store.stats()
    assert (s["memory"].puts, s["disk"].puts) == (1, 1)
    assert (s["memory"].entries, s["disk"].entries) == (1, 1)


def test_put_with_pin_pins_in_both_tiers(tiers):
    store, _, _ = tiers
    store.put(key(1), chunk(), pin=True)
    s = store.stats()
    assert (s["memory"].pinned, s["disk"].pinned) == (1, 1)


def test_pin_pins_in_both_tiers(tiers):
    store, _, _ = tiers
    store.put(key(1), chunk())
    store.flush()
    assert store.pin(key(1)) is True
    s = store.stats()
    assert (s["memory"].pinned, s["disk"].pinned) == (1, 1)
    assert store.pin(key(1), False) is True
    s = store.stats()
    assert (s["memory"].pinned, s["disk"].pinned) == (0, 0)


def test_pin_of_a_key_in_one_tier_only(tiers):
    store, memory, disk = tiers
    disk.put(key(1), chunk())
    disk.flush()
    assert store.pin(key(1)) is True
    s = store.stats()
    assert (s["memory"].pinned, s["disk"].pinned) == (0, 1)
    memory.put(key(2), chunk())
    assert store.pin(key(2)) is True
    assert store.stats()["memory"].pinned == 1


def test_pin_of_an_unknown_key_is_false(tiers):
    store, _, _ = tiers
    assert store.pin(key(404)) is False


def test_pinned_entry_survives_memory_pressure_in_the_memory_tier(tight):
    store, memory, _ = tight(2)
    store.put(key(0), chunk(seed=0))
    store.flush()
    assert store.pin(key(0))
    for i in range(1, 6):
        store.put(key(i), chunk(seed=i), cost=100.0)
    assert memory.contains(key(0))
    assert store.get(key(0)).tier == "memory"


def test_stats_merge_both_tier_names(tiers):
    store, _, _ = tiers
    stats = store.stats()
    assert set(stats) == {"memory", "disk"}
    assert list(stats) == ["memory", "disk"]  # fastest first


def test_contains(tiers):
    store, memory, disk = tiers
    memory.put(key(1), chunk())
    disk.put(key(2), chunk())
    disk.flush()
    assert store.contains(key(1))
    assert store.contains(key(2))
    assert not store.contains(key(3))
    s = store.stats()
    assert s["memory"].hits == s["memory"].misses == s["disk"].hits == s["disk"].misses == 0


def test_evicted_from_memory_is_still_served_from_disk(tight):
    store, memory, _ = tight(1)
    store.put(key(1), chunk(seed=1))
    store.put(key(2), chunk(seed=2))
    store.flush()
    assert not memory.contains(key(1))
    hit = store.get(key(1))
    assert hit.tier == "disk" and same(hit.chunk, chunk(seed=1))
    assert store.get(key(1)).tier == "memory"


def test_survives_a_restart_through_the_disk_tier(tmp_path):
    first = TieredStore([MemoryStore(1 << 20), DiskStore(tmp_path / "store", namespace=NS)])
    first.put(key(1), chunk(seed=5, logits=True))
    first.close()
    second = TieredStore([MemoryStore(1 << 20), DiskStore(tmp_path / "store", namespace=NS)])
    try:
        assert [second.get(key(1)).tier, second.get(key(1)).tier] == ["disk", "memory"]
        assert same(second.get(key(1)).chunk, chunk(seed=5, logits=True))
    finally:
        second.close()


# -- recompute cost across promotion -------------------------------------------------------


def test_promotion_keeps_the_cost_the_entry_was_stored_with(tiers):
    store, memory, disk = tiers
    disk.put(key(1), chunk(seed=1), cost=123.5)
    disk.flush()
    hit = store.get(key(1))
    assert hit.tier == "disk" and hit.cost == 123.5
    assert memory.get(key(1)).cost == 123.5  # not the chunk's length, not the default


def test_promotion_of_an_entry_without_a_recorded_cost_weighs_it_by_its_length():
    """An entry written before costs were stored is promoted as it was then: cost = its tokens."""

    class Legacy(MemoryStore):
        name = "legacy"

        def get(self, key):
            hit = super().get(key)
            return None if hit is None else hit._replace(tier=self.name, cost=None)

    memory, legacy = MemoryStore(1 << 20), Legacy(1 << 20)
    legacy.put(key(1), chunk(tokens=6), cost=99.0)
    store = TieredStore([memory, legacy])
    assert store.get(key(1)).tier == "legacy"
    assert memory.get(key(1)).cost == 6


def test_a_promoted_entry_keeps_its_rank_in_memory(tight):
    """A costly entry read back from disk is not the first to go when memory fills up."""
    store, memory, disk = tight(2)
    disk.put(key(1), chunk(seed=1), cost=1000.0)
    disk.flush()
    store.get(key(1))  # promoted with its cost
    store.put(key(2), chunk(seed=2), cost=1.0)
    store.put(key(3), chunk(seed=3), cost=1.0)
    assert memory.contains(key(1)) and not memory.contains(key(2))


def test_remove_and_clear_reach_every_tier(tiers):
    store, memory, disk = tiers
    store.put(key(1), chunk(seed=1))
    disk.put(key(2), chunk(seed=2))  # in one tier only
    store.flush()
    assert store.remove(key(2)) is True and not disk.contains(key(2))
    assert store.remove(key(1)) is True
    assert not memory.contains(key(1)) and not disk.contains(key(1))
    store.put(key(3), chunk(seed=3))
    store.flush()
    store.clear()
    assert not memory.contains(key(3)) and not disk.contains(key(3))
