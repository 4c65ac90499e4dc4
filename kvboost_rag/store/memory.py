"""Memory tier: chunk KV on the model's device under a byte budget.

Eviction is GreedyDual-Size-Frequency: each entry has the priority
``clock + hits * cost / bytes`` and the lowest goes first; the clock rises to
the evicted priority, so entries that are not used again age out (recency),
entries used often stay (frequency), and small, expensive-to-recompute entries
are kept over large, cheap ones (size and cost). Pinned entries are never
evicted.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass

from .base import Hit, KVStore, StoredChunk, TierStats


@dataclass
class _Entry:
    chunk: StoredChunk
    cost: float
    hits: int
    priority: float
    pinned: bool
    version: int


class MemoryStore(KVStore):
    """Byte-budgeted in-process tier.

    >>> import torch
    >>> store = MemoryStore(max_bytes=1 << 20)
    >>> store.put("k", StoredChunk(torch.zeros(1, 2, 1, 4, 8)))
    >>> store.get("k").tier
    'memory'
    """

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []  # (priority, version, key); stale items skipped
        self._versions = itertools.count()
        self._clock = 0.0
        self._bytes = 0
        self._stats = TierStats()
        self._lock = threading.Lock()

    def _priority(self, entry: _Entry) -> float:
        return self._clock + entry.hits * entry.cost / max(entry.chunk.nbytes, 1)

    def _touch(self, key: str, entry: _Entry) -> None:
        entry.priority = self._priority(entry)
        entry.version = next(self._versions)
        heapq.heappush(self._heap, (entry.priority, entry.version, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            # Every touch leaves a stale item behind; rebuild before they pile up.
            self._heap = [(e.priority, e.version, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

    def get(self, key: str) -> Hit | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            entry.hits += 1
            self._touch(key, entry)
            return Hit(entry.chunk, self.name)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        size = chunk.nbytes
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.chunk.nbytes
                pin = pin or old.pinned
            if size > self.max_bytes and not pin:
                return  # larger than the whole budget: not worth evicting everything for
            entry = _Entry(chunk, cost, hits=1 if old is None else old.hits, priority=0.0, pinned=pin, version=0)
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
                self._touch(key, entry)
                self._evict_over_budget()
            return True

    def _evict_over_budget(self) -> None:
        while self._bytes > self.max_bytes and self._heap:
            priority, version, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is None or entry.version != version or entry.pinned:
                continue  # stale heap item, or pinned (re-pushed when unpinned)
            self._clock = priority
            del self._entries[key]
            self._bytes -= entry.chunk.nbytes
            self._stats.evictions += 1

    def remove(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= entry.chunk.nbytes
            return entry is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._heap.clear()
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
