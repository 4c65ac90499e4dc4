"""KV stores: a small put/get interface, its tiers, and a composite that chains them."""

from .base import Hit, KVStore, StoredChunk, TierStats
from .disk import DiskStore
from .memory import MemoryStore
from .serialization import CorruptEntryError
from .tiered import TieredStore

__all__ = ["CorruptEntryError", "DiskStore", "Hit", "KVStore", "MemoryStore", "StoredChunk", "TierStats", "TieredStore"]
