"""The store interface: what every tier (memory, disk, ...) offers the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


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

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.last_logits is None else self.last_logits.nbytes
        return self.kv.nbytes + extra


class Hit(NamedTuple):
    chunk: StoredChunk
    tier: str
    """Name of the tier that served it (``"memory"``, ``"disk"``, ...)."""


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


class KVStore(ABC):
    """A tier keyed by prefix key. Implementations must be thread-safe.

    ``cost`` passed to :meth:`put` is the estimated work to recompute the chunk
    (token-positions); eviction weighs it against size, recency and frequency.
    """

    name: str

    @abstractmethod
    def get(self, key: str) -> Hit | None: ...

    @abstractmethod
    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def pin(self, key: str, pinned: bool = True) -> bool:
        """Pin (or unpin) a stored entry; returns whether it was present."""

    @abstractmethod
    def stats(self) -> dict[str, TierStats]: ...

    def flush(self) -> None:
        """Wait for pending writes (a no-op for synchronous tiers)."""

    def close(self) -> None:
        self.flush()
