"""KV stores: a small put/get interface, its tiers, and a composite that chains them.

``open_store`` builds the engine's store from its configuration. ``RedisStore`` (the shared
remote tier) and its ``RedisOptions`` are imported on first use, since they need the optional
``redis`` package: ``from kvboost_rag.store import RedisStore``.
"""

from typing import Any

from .base import Hit, KVStore, StoredChunk, TierStats
from .disk import DiskStore
from .eviction import EvictionPolicy
from .factory import open_store
from .memory import MemoryStore
from .serialization import CorruptEntryError, ForeignEntryError
from .tiered import TieredStore

__all__ = [
    "CorruptEntryError",
    "ForeignEntryError",
    "DiskStore",
    "EvictionPolicy",
    "Hit",
    "KVStore",
    "MemoryStore",
    "StoredChunk",
    "TierStats",
    "TieredStore",
    "open_store",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    if name == "RedisOptions":
        from .redis_options import RedisOptions

        return RedisOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
