"""A composite store: tiers read through in order, hits promoted into the faster tiers."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Hit, KVStore, StoredChunk, TierStats


class TieredStore(KVStore):
    """``tiers[0]`` is the fastest. Puts go to every tier; a hit in a slower tier is
    copied into the faster ones so the next read is fast.

    >>> import tempfile, torch
    >>> from kvboost_rag.store import DiskStore, MemoryStore
    >>> disk = DiskStore(tempfile.mkdtemp(), namespace="ns")
    >>> disk.put("k", StoredChunk(torch.ones(1, 2, 1, 3, 4))); disk.flush()
    >>> store = TieredStore([MemoryStore(1 << 20), disk])
    >>> store.get("k").tier, store.get("k").tier
    ('disk', 'memory')
    >>> store.close()
    """

    name = "tiered"

    def __init__(self, tiers: Sequence[KVStore]) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)

    def get(self, key: str) -> Hit | None:
        for level, tier in enumerate(self.tiers):
            hit = tier.get(key)
            if hit is not None:
                for faster in self.tiers[:level]:
                    faster.put(key, hit.chunk, cost=hit.chunk.num_tokens)
                return hit
        return None

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        for tier in self.tiers:
            tier.put(key, chunk, cost=cost, pin=pin)

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def pin(self, key: str, pinned: bool = True) -> bool:
        return any([tier.pin(key, pinned) for tier in self.tiers])  # a list: pin in every tier

    def stats(self) -> dict[str, TierStats]:
        out: dict[str, TierStats] = {}
        for tier in self.tiers:
            out.update(tier.stats())
        return out

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
