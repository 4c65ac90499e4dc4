"""The document registry's shared part, kept in the Redis tier: document texts and blend sources.

Processes that share only a Redis server, not a store directory, learn from these records which
documents another process pre-warmed, so a flat prompt can be split at them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from ..registry import MIN_DOCUMENT_CHARS, Source


class RecordTier(Protocol):
    """What the records need of the tier that keeps them: the record methods of
    :class:`~.redis.RedisStore` (named here, not imported, so this module does not depend on it)."""

    @property
    def registry_refresh_s(self) -> float:
        """Seconds between two reads of the shared document list."""
        ...

    def add_documents(self, texts: Sequence[str]) -> None: ...

    def documents_from(self, start: int) -> tuple[int, list[str]] | None: ...

    def add_sources(self, sources: Mapping[str, Source]) -> None: ...

    def sources(self, content_keys: Sequence[str]) -> dict[str, Source]: ...


class RedisRecords:
    """:class:`~kvboost_rag.registry.SharedRecords` of one namespace, on a :class:`~.redis.RedisStore`.

    Writes go through the store's write-back queue; reads are single quick calls that
    come back empty while Redis is away. :meth:`new_documents` asks Redis at most every
    ``registry_refresh_s`` seconds, so a document pre-warmed elsewhere is found within
    that delay. The records are small; they never expire and are not counted in
    ``max_bytes`` (a document whose KV is gone is simply a miss and computed again).
    """

    def __init__(self, store: RecordTier) -> None:
        self._store = store
        self._cursor = 0  # how much of the shared document list this process has read
        self._next_poll = 0.0
        self._lock = threading.Lock()

    def publish_documents(self, texts: Sequence[str]) -> None:
        """Add document texts (already normalized) to the namespace's shared list."""
        texts = [t for t in dict.fromkeys(texts) if len(t) >= MIN_DOCUMENT_CHARS]
        if texts:
            self._store.add_documents(texts)

    def new_documents(self) -> list[str]:
        """Documents added by any process since the last call; polls at most every ``registry_refresh_s``."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_poll:
                return []
            self._next_poll = now + self._store.registry_refresh_s
            read = self._store.documents_from(self._cursor)
            if read is None:
                return []
            count, texts = read
            self._cursor += count
        return texts

    def publish_sources(self, sources: Mapping[str, Source]) -> None:
        """Record where document chunks are stored, by content key (blend mode)."""
        if sources:
            self._store.add_sources(sources)

    def sources(self, content_keys: Sequence[str]) -> dict[str, Source]:
        """The stored locations of document chunks that any process recorded."""
        return self._store.sources(content_keys)
