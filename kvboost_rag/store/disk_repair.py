"""Repair of a disk tier directory: what ``verify`` and ``repair`` (:mod:`kvboost_rag.maintenance`) call.

The payload files and the eviction index can disagree after a crash, a damaged database or a
copy of the directory: an entry the index lost, an index row without a payload, a payload file
that diskcache's table no longer names. Every payload carries its own namespace and key in a
checked header, so each of these is settled from the payload alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import diskcache

from . import disk_files
from .base import StoredChunk
from .disk_index import DiskIndex
from .serialization import CorruptEntryError, Entry, claimed_owner, decode_entry


class DiskRepair:
    """The repair methods of :class:`~.disk.DiskStore`, over its payloads and its index."""

    directory: Path
    secrets: tuple[bytes, ...]
    _cache: diskcache.Cache
    _index: DiskIndex

    if TYPE_CHECKING:

        def flush(self) -> None: ...

    def read_checked(self, key: str, namespace: str) -> StoredChunk:
        """Read and check one entry of any namespace; raises :class:`CorruptEntryError` or
        :class:`ForeignEntryError`."""
        data = disk_files.read_payload(self._cache, key)
        if data is None:
            raise CorruptEntryError("no payload for an indexed key")
        return decode_entry(data, namespace, key, secret=self.secrets).chunk

    def stored_keys(self) -> list[str]:
        """Every key with a payload, of every namespace, whether the index knows it or not."""
        self.flush()
        return [key for key in self._cache.iterkeys() if isinstance(key, str)]

    def indexed_namespaces(self) -> dict[str, str]:
        """``{key: namespace}`` of every entry the index knows."""
        self.flush()
        return self._index.namespaces_by_key()

    def reindex(self, key: str) -> str:
        """Check an entry that the index lost and index it again (under the namespace its checked
        header names); returns that namespace. Raises :class:`CorruptEntryError`."""
        data = disk_files.read_payload(self._cache, key)
        if data is None:
            raise CorruptEntryError("no payload")
        namespace, claimed = claimed_owner(data)
        if claimed != key:
            raise CorruptEntryError("entry belongs to another key")
        # intact is enough to index it (a foreign entry is evicted in time; it is never served)
        entry = decode_entry(data, namespace, key, check_signature=False)
        self._index_intact(key, namespace, len(data), entry)
        return namespace

    def remove_orphans(self, min_age_s: float = 60.0) -> int:
        """Delete index rows without a payload, and payload files that no entry names (older than
        ``min_age_s``: a concurrent write creates its file just before its row); returns how many."""
        self.flush()
        stored = set(self.stored_keys())
        rows = [key for key in self.indexed_namespaces() if key not in stored]
        self._index.delete(rows)
        cutoff = time.time() - min_age_s
        files = [p for p in self.unnamed_files() if p.stat().st_mtime < cutoff]
        for path in files:
            path.unlink(missing_ok=True)
        return len(rows) + len(files)

    def unnamed_files(self) -> list[Path]:
        """Payload files under the directory that no entry of the payload database names."""
        return disk_files.unnamed_files(self.directory)

    def adopt(self, path: Path) -> str:
        """Store a payload file that no entry names under the key its checked header names, then
        delete the file; returns the key. Raises :class:`CorruptEntryError` (the file is kept)."""
        data = path.read_bytes()
        namespace, key = claimed_owner(data)
        entry = decode_entry(data, namespace, key, check_signature=False)  # intact: see reindex
        if key in self._cache:  # stored again since: that entry wins, this file is a stale copy
            path.unlink()
            return key
        self._cache.set(key, data)
        self._index_intact(key, namespace, len(data), entry)
        path.unlink()
        return key

    def _index_intact(self, key: str, namespace: str, nbytes: int, entry: Entry) -> None:
        """Index an intact entry found on disk, unpinned, at the cost its header records."""
        cost = entry.cost or 1.0
        self._index.add(
            key, namespace=namespace, nbytes=nbytes, tokens=entry.chunk.num_tokens, cost=cost, pin=False
        )
