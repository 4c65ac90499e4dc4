"""The store interface: what every tier (memory, disk, ...) offers the engine."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from .codecs import CODECS

if TYPE_CHECKING:
    from ..registry import SharedRecords


@dataclass(frozen=True)
class StoredChunk:
    """The KV of one chunk, as stored.

    ``kv`` layout: ``[layers, 2, kv_heads, tokens, head_dim]`` (index 0 keys, 1 values),
    keys already rotated for the chunk's absolute positions.
    """

    kv: torch.Tensor
    last_logits: torch.Tensor | None = None
    """float32 ``[vocab]`` logits at the chunk's last position, kept for a prompt's final chunk."""
    token_ids: tuple[int, ...] | None = None
    """The chunk's tokens; with ``parent_key`` they let ``verify`` rebuild and recompute any entry."""
    parent_key: str | None = None
    """Prefix key of the chunk before this one (None for a prompt's first chunk)."""
    codec: str = "raw"
    """The codec ``kv`` was read back through (:mod:`.codecs`); ``raw``: as computed."""

    @property
    def approximate(self) -> bool:
        """``kv`` came back from a lossy codec: reusing it is not exact."""
        return CODECS[self.codec].approximate

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.last_logits is None else self.last_logits.nbytes
        return self.kv.nbytes + extra


class Hit(NamedTuple):
    """A chunk found in a tier."""

    chunk: StoredChunk
    tier: str
    """Name of the tier that served it (``"memory"``, ``"disk"``, ...)."""
    cost: float | None = None
    """The recompute cost it was stored with (see :meth:`KVStore.put`); ``None`` when the tier does not
    know it (an entry written before costs were stored). Kept when a hit is copied into a faster tier."""


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    pinned: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class TierCounters:
    """A tier's running counts (hits, misses, puts, evictions and named extras), safe from any thread.

    >>> c = TierCounters(extra=["corrupt"])
    >>> c.read(found=False); c.add("corrupt")
    >>> s = c.snapshot(); (s.misses, s.extra)
    (1, {'corrupt': 1})
    """

    _FIELDS = frozenset({"hits", "misses", "puts", "evictions"})

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self._stats = TierStats(extra=dict.fromkeys(extra, 0))
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``hits``, ``misses``, ``puts``, ``evictions`` or the extra counter ``name``."""
        with self._lock:
            if name in self._FIELDS:
                setattr(self._stats, name, getattr(self._stats, name) + n)
            else:
                self._stats.extra[name] = self._stats.extra.get(name, 0) + n

    def read(self, *, found: bool) -> None:
        self.add("hits" if found else "misses")

    def snapshot(self) -> TierStats:
        """A copy of the counts (sizes left at zero for the tier to fill in)."""
        with self._lock:
            return replace(self._stats, extra=dict(self._stats.extra))


class KVStore(ABC):
    """A tier keyed by prefix key. Implementations must be thread-safe.

    ``cost`` passed to :meth:`put` is the estimated work to recompute the chunk
    (token-positions); eviction weighs it against size, recency and frequency.
    """

    name: str

    @abstractmethod
    def get(self, key: str) -> Hit | None:
        """The stored chunk, or None (a miss: absent, or unusable and removed); counted in :meth:`stats`."""

    @abstractmethod
    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        """Store (or replace) a chunk; a slow tier may write it later (:meth:`flush` waits) or drop it."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether the key is stored; not counted as a read."""

    @abstractmethod
    def pin(self, key: str, pinned: bool = True) -> bool:
        """Pin (or unpin) a stored entry; returns whether it was present."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Delete one entry; returns whether it was present."""

    @abstractmethod
    def clear(self) -> None:
        """Delete every entry this tier holds for its namespace (the counters are kept)."""

    @abstractmethod
    def stats(self) -> dict[str, TierStats]:
        """Counters and sizes, one :class:`TierStats` per tier name, fastest tier first."""

    @property
    def tiers(self) -> list[KVStore]:
        """The tiers behind this store, fastest first: ``[self]`` for a single tier."""
        return [self]

    def shared_records(self) -> SharedRecords | None:
        """Registry records this store keeps for other processes (the Redis tier's), or None."""
        return None

    def flush(self) -> None:  # noqa: B027  (empty on purpose: a synchronous tier has nothing to wait for)
        """Wait for pending writes (a no-op for synchronous tiers)."""

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
