"""Disk tier (L3): chunk KV in a ``diskcache`` directory, shared by processes and restarts.

- Payloads go through :class:`KVDisk`, a ``diskcache.Disk`` that writes our checked
  raw-buffer format (:mod:`.serialization`) and refuses to pickle anything.
- Eviction metadata (size, recompute cost, hits, last access, pin) lives in a small
  SQLite index beside the payloads, so every process sees the same pins and scores.
- Writes run on a background thread so the cold path never waits on the disk;
  :meth:`DiskStore.flush` (called by ``close()`` and at exit) waits for them.
- A corrupt, truncated or foreign entry is a miss: it is removed, counted and logged.
- A full disk turns the tier off with a warning; generation carries on from memory.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diskcache

from ..errors import StoreError
from .base import Hit, KVStore, StoredChunk, TierCounters, TierStats
from .serialization import CorruptEntryError, decode, encode
from .writer import BackgroundWriter, close_at_exit, closed

logger = logging.getLogger(__name__)

RECENCY_HALF_LIFE_S = 3600.0
"""Age at which an entry's eviction score is halved."""


class KVDisk(diskcache.Disk):
    """diskcache serializer for KV entries: raw buffers with a checked header, never pickle."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if not isinstance(key, str):
            raise TypeError(f"kvboost store keys are strings, got {type(key).__name__}")
        return super().put(key)

    def store(self, value: Any, read: bool, key: Any = diskcache.UNKNOWN) -> tuple:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"kvboost store values are encoded bytes, got {type(value).__name__} (never pickled)")
        return super().store(bytes(value), read, key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> bytearray:
        if mode == diskcache.core.MODE_RAW and isinstance(value, (bytes, sqlite3.Binary)):
            return bytearray(value)
        if mode == diskcache.core.MODE_BINARY and filename is not None:
            path = os.path.join(self._directory, filename)
            try:
                with open(path, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    buffer = bytearray(size)  # writable, so tensors can view it without a copy
                    if f.readinto(buffer) != size:
                        raise CorruptEntryError("short read")
                    return buffer
            except FileNotFoundError as e:
                raise MissingPayloadError("payload file is missing") from e
        raise CorruptEntryError(f"value of storage mode {mode} in a KV store: refused (never unpickled)")


class MissingPayloadError(CorruptEntryError):
    """The row names a payload file that is gone (deleted, or replaced by a concurrent write)."""


class _Index:
    """Eviction metadata shared through SQLite (WAL): one row per entry."""

    def __init__(self, path: Path) -> None:
        self._con = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._con.execute("PRAGMA journal_mode=WAL")
            self._con.execute("PRAGMA synchronous=NORMAL")
            self._con.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, namespace TEXT NOT NULL,"
                " bytes INTEGER NOT NULL, tokens INTEGER NOT NULL, cost REAL NOT NULL, hits INTEGER NOT NULL,"
                " last_access REAL NOT NULL, pinned INTEGER NOT NULL DEFAULT 0)"
            )
            self._con.execute("CREATE INDEX IF NOT EXISTS entries_namespace ON entries(namespace)")

    def execute(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._con.execute(sql, args).fetchall()

    def executemany(self, sql: str, rows: list[tuple]) -> None:
        with self._lock:
            self._con.execute("BEGIN IMMEDIATE")
            try:
                self._con.executemany(sql, rows)
            except BaseException:
                self._con.execute("ROLLBACK")
                raise
            self._con.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._con.close()


class DiskStore(KVStore):
    """Persistent tier for one namespace in ``directory``.

    >>> import tempfile, torch
    >>> store = DiskStore(tempfile.mkdtemp(), namespace="ns")
    >>> store.put("k", StoredChunk(torch.ones(1, 2, 1, 3, 4)))
    >>> store.flush()
    >>> store.get("k").tier
    'disk'
    >>> store.close()
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        namespace: str,
        *,
        max_bytes: int | None = None,
        background_writes: bool = True,
    ) -> None:
        self.directory = Path(directory).expanduser()
        self.namespace = namespace
        self.max_bytes = max_bytes
        _check_writable(self.directory)
        self._cache = diskcache.Cache(
            str(self.directory / "kv"),
            disk=KVDisk,
            size_limit=2**62,  # eviction is ours (cost- and pin-aware), not diskcache's
            eviction_policy="none",
            cull_limit=0,
            statistics=False,
        )
        self._index = _Index(self.directory / "index.sqlite")
        self._counters = TierCounters()
        self._disabled_reason: str | None = None
        self._writer = BackgroundWriter(self._apply, name="kvboost-disk-writer", background=background_writes)
        self._closed = False
        close_at_exit(self)

    # -- KVStore -----------------------------------------------------------------------------

    def _read(self, key: str) -> bytearray | None:
        try:
            return self._cache.get(key, default=None, read=True)
        except MissingPayloadError:
            # Another process may have replaced the entry between our row lookup and the
            # file open (the old file is deleted then): look again before calling it corrupt.
            return self._cache.get(key, default=None, read=True)

    def get(self, key: str) -> Hit | None:
        try:
            data = self._read(key)
            chunk = None if data is None else decode(data, self.namespace, key)
        except CorruptEntryError as e:
            self._drop_corrupt(key, str(e))
            chunk = None
        except (OSError, sqlite3.Error) as e:
            logger.warning("disk tier read failed for %s… (%s); treating it as a miss", key[:12], e)
            chunk = None
        self._counters.read(found=chunk is not None)
        if chunk is None:
            return None
        self._writer.submit(("touch", key, time.time()))
        return Hit(chunk, self.name)

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        if self._disabled_reason is None:
            self._writer.submit(("put", key, chunk, cost, pin))

    def contains(self, key: str) -> bool:
        return key in self._cache

    def pin(self, key: str, pinned: bool = True) -> bool:
        self.flush()
        found = self._index.execute("SELECT 1 FROM entries WHERE key = ?", (key,))
        self._index.execute("UPDATE entries SET pinned = ? WHERE key = ?", (int(pinned), key))
        return bool(found)

    def stats(self) -> dict[str, TierStats]:
        self.flush()
        s = self._counters.snapshot()
        ((entries, nbytes, pinned),) = self._index.execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0), COALESCE(SUM(pinned), 0) FROM entries WHERE namespace = ?",
            (self.namespace,),
        )
        s.entries, s.bytes, s.pinned = entries, nbytes, pinned
        return {self.name: s}

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._cache.close()
        self._index.close()
        closed(self)

    # -- maintenance -------------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        self.flush()
        self._index.execute("DELETE FROM entries WHERE key = ?", (key,))
        return bool(self._cache.delete(key))

    def usage(self) -> dict[str, dict[str, int]]:
        """Per namespace: entries, bytes, reads (hits after the first store) and pinned entries."""
        self.flush()
        rows = self._index.execute(
            "SELECT namespace, COUNT(*), SUM(bytes), SUM(hits) - COUNT(*), SUM(pinned) FROM entries GROUP BY namespace"
        )
        return {ns: {"entries": n, "bytes": b, "reads": r, "pinned": p} for ns, n, b, r, p in rows}

    def namespaces(self) -> dict[str, tuple[int, int]]:
        """``{namespace: (entries, bytes)}`` over the whole directory."""
        return {ns: (u["entries"], u["bytes"]) for ns, u in self.usage().items()}

    def keys(self, namespace: str | None = None) -> Iterator[str]:
        """Keys of one namespace (default: this store's), or of all when ``namespace == "*"``."""
        self.flush()
        ns = self.namespace if namespace is None else namespace
        sql = "SELECT key FROM entries" + ("" if ns == "*" else " WHERE namespace = ?")
        for (key,) in self._index.execute(sql, () if ns == "*" else (ns,)):
            yield key

    def drop_namespaces(self, keep: set[str]) -> int:
        """Delete every entry whose namespace is not in ``keep``; returns how many."""
        self.flush()
        rows = self._index.execute("SELECT key, namespace FROM entries")
        doomed = [key for key, ns in rows if ns not in keep]
        self._delete(doomed)
        return len(doomed)

    def clear(self) -> None:
        self.flush()
        self._cache.clear()
        self._index.execute("DELETE FROM entries")

    def read_checked(self, key: str, namespace: str) -> StoredChunk:
        """Read and check one entry of any namespace; raises :class:`CorruptEntryError`."""
        data = self._read(key)
        if data is None:
            raise CorruptEntryError("no payload for an indexed key")
        return decode(data, namespace, key)

    def evict_to(self, max_bytes: int) -> int:
        """Evict unpinned entries, lowest score first, until the directory holds ``max_bytes``."""
        ((total,),) = self._index.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries")
        if total <= max_bytes:
            return 0
        now = time.time()
        candidates = self._index.execute(
            "SELECT key, bytes FROM entries WHERE pinned = 0"
            " ORDER BY (hits * cost / MAX(bytes, 1)) / (1.0 + (? - last_access) / ?) ASC",
            (now, RECENCY_HALF_LIFE_S),
        )
        doomed = []
        for key, nbytes in candidates:
            if total <= max_bytes:
                break
            doomed.append(key)
            total -= nbytes
        self._delete(doomed)
        self._counters.add("evictions", len(doomed))
        return len(doomed)

    # -- internals ---------------------------------------------------------------------------

    def _apply(self, item: tuple) -> None:
        if item[0] == "touch":
            _, key, now = item
            self._index.execute("UPDATE entries SET hits = hits + 1, last_access = ? WHERE key = ?", (now, key))
            return
        _, key, chunk, cost, pin = item
        if self._disabled_reason is not None:
            return
        try:
            data = encode(chunk, self.namespace, key)
            self._cache.set(key, data)
            self._index.execute(
                "INSERT INTO entries (key, namespace, bytes, tokens, cost, hits, last_access, pinned)"
                " VALUES (?, ?, ?, ?, ?, 1, ?, ?) ON CONFLICT(key) DO UPDATE SET namespace = excluded.namespace,"
                " bytes = excluded.bytes, tokens = excluded.tokens, cost = excluded.cost,"
                " last_access = excluded.last_access, pinned = MAX(pinned, excluded.pinned)",
                (key, self.namespace, len(data), chunk.num_tokens, cost, time.time(), int(pin)),
            )
        except (OSError, sqlite3.OperationalError) as e:
            if _is_disk_full(e):
                self._disabled_reason = str(e)
                logger.warning("disk tier is full (%s); continuing with the memory tier only", e)
                return
            raise
        self._counters.add("puts")
        if self.max_bytes is not None:
            self.evict_to(self.max_bytes)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self._cache.delete(key)
        if keys:
            self._index.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])

    def _drop_corrupt(self, key: str, reason: str) -> None:
        logger.warning("disk tier entry %s… is unusable (%s); removed, it will be recomputed", key[:12], reason)
        self._counters.add("corrupt")
        try:
            self._delete([key])
        except (OSError, sqlite3.Error) as e:
            logger.warning("could not remove corrupt entry %s… (%s)", key[:12], e)

    @property
    def disabled_reason(self) -> str | None:
        """Why the tier stopped writing (a full disk), or None."""
        return self._disabled_reason


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, sqlite3.OperationalError) and "full" in str(e).lower()


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".kvboost-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        msg = (
            f"cannot use {str(directory)!r} as a KV store ({e.strerror or e}); pass a store_dir on a "
            "writable filesystem, or store_dir=None for the memory tier only"
        )
        raise StoreError(msg) from e
