"""KV stores: a small put/get interface, its tiers, and a composite that chains them.

``RedisStore`` (the shared remote tier) is imported on first use, since it needs the
optional ``redis`` package: ``from kvboost_rag.store import RedisStore``.
"""

from typing import Any

from .base import Hit, KVStore, StoredChunk, TierStats
from .disk import DiskStore
from .memory import MemoryStore
from .serialization import CorruptEntryError
from .tiered import TieredStore

__all__ = ["CorruptEntryError", "DiskStore", "Hit", "KVStore", "MemoryStore", "StoredChunk", "TierStats", "TieredStore"]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
