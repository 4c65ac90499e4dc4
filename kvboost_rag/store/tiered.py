"""A composite store: tiers read through in order, hits promoted into the faster tiers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Hit, KVStore, StoredChunk, TierStats

if TYPE_CHECKING:
    from ..registry import SharedRecords


class TieredStore(KVStore):
    """``tiers[0]`` is the fastest. Puts go to every tier; a hit in a slower tier is
    copied into the faster ones (with the cost it was stored with) so the next read is fast.

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
        self._tiers = list(tiers)

    @property
    def tiers(self) -> list[KVStore]:
        return list(self._tiers)

    def get(self, key: str) -> Hit | None:
        for level, tier in enumerate(self._tiers):
            hit = tier.get(key)
            if hit is not None:
                # An entry from before costs were stored is weighed by its length, as it was then.
                cost = hit.cost if hit.cost is not None else hit.chunk.num_tokens
                for faster in self._tiers[:level]:
                    faster.put(key, hit.chunk, cost=cost)
                return hit
        return None

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        for tier in self._tiers:
            tier.put(key, chunk, cost=cost, pin=pin)

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self._tiers)

    def pin(self, key: str, pinned: bool = True) -> bool:
        found = [tier.pin(key, pinned) for tier in self._tiers]  # in every tier, not up to the first
        return any(found)

    def remove(self, key: str) -> bool:
        found = [tier.remove(key) for tier in self._tiers]  # from every tier, not up to the first
        return any(found)

    def clear(self) -> None:
        for tier in self._tiers:
            tier.clear()

    def stats(self) -> dict[str, TierStats]:
        out: dict[str, TierStats] = {}
        for tier in self._tiers:
            out.update(tier.stats())
        return out

    def shared_records(self) -> SharedRecords | None:
        """The first tier's that has any (the Redis tier's)."""
        for tier in self._tiers:
            records = tier.shared_records()
            if records is not None:
                return records
        return None

    def flush(self) -> None:
        for tier in self._tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self._tiers:
            tier.close()
