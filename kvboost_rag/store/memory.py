"""Memory tier: chunk KV on the model's device under a byte budget.

Eviction is GreedyDual-Size-Frequency (:mod:`.eviction`): entries that are not used again
age out (recency), entries used often stay (frequency), and small, expensive-to-recompute
entries are kept over large, cheap ones (size and cost). Pinned entries are never evicted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .base import Hit, KVStore, StoredChunk, TierStats
from .eviction import EvictionPolicy, GreedyDualQueue


@dataclass
class _Entry:
    chunk: StoredChunk
    cost: float
    hits: int
    pinned: bool


class MemoryStore(KVStore):
    """Byte-budgeted in-process tier.

    >>> import torch
    >>> store = MemoryStore(max_bytes=1 << 20)
    >>> store.put("k", StoredChunk(torch.zeros(1, 2, 1, 4, 8)))
    >>> store.get("k").tier
    'memory'
    """

    name = "memory"

    def __init__(self, max_bytes: int, *, policy: EvictionPolicy | None = None) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        self._queue = GreedyDualQueue(policy or EvictionPolicy())
        self._bytes = 0
        self._stats = TierStats()
        self._lock = threading.Lock()

    def _touch(self, key: str, entry: _Entry) -> None:
        self._queue.touch(key, hits=entry.hits, cost=entry.cost, nbytes=entry.chunk.nbytes)

    def get(self, key: str) -> Hit | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            entry.hits += 1
            self._touch(key, entry)
            return Hit(entry.chunk, self.name, entry.cost)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        size = chunk.nbytes
        with self._lock:
            old = self._pop(key)
            if old is not None:
                pin = pin or old.pinned
            if size > self.max_bytes and not pin:
                return  # larger than the whole budget: not worth evicting everything for
            entry = _Entry(chunk, cost, hits=1 if old is None else old.hits, pinned=pin)
            self._entries[key] = entry
            self._bytes += size
            self._stats.puts += 1
            self._touch(key, entry)
            self._evict_over_budget()

    def pin(self, key: str, pinned: bool = True) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.pinned = pinned
            if not pinned:
                self._touch(key, entry)  # pinned entries left the queue when it reached them
                self._evict_over_budget()
            return True

    def remove(self, key: str) -> bool:
        with self._lock:
            return self._pop(key) is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._queue.clear()
            self._bytes = 0

    def stats(self) -> dict[str, TierStats]:
        with self._lock:
            s = self._stats
            return {
                self.name: TierStats(
                    hits=s.hits,
                    misses=s.misses,
                    puts=s.puts,
                    evictions=s.evictions,
                    entries=len(self._entries),
                    bytes=self._bytes,
                    pinned=sum(e.pinned for e in self._entries.values()),
                )
            }

    def __len__(self) -> int:
        return len(self._entries)

    def _pop(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.chunk.nbytes
            self._queue.discard(key)
        return entry

    def _evict_over_budget(self) -> None:
        while self._bytes > self.max_bytes:
            key = self._queue.pop(lambda k: not self._entries[k].pinned)
            if key is None:
                return  # only pinned entries are left
            self._pop(key)
            self._stats.evictions += 1
