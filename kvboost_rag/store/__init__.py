"""KV stores: a small put/get interface and its tiers."""

from .base import Hit, KVStore, StoredChunk, TierStats
from .memory import MemoryStore

__all__ = ["Hit", "KVStore", "MemoryStore", "StoredChunk", "TierStats"]
