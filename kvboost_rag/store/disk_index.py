"""The disk tier's eviction index: one SQLite row per entry, shared by every process on the directory.

Each row holds what eviction and the maintenance commands need (namespace, size, tokens,
recompute cost, hits, last access, pin) without opening a payload. The database runs in WAL
mode, so readers never wait for the one writer; every statement of the index is in
:class:`DiskIndex`.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .eviction import Candidate


class DiskIndex:
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

    # -- writes -------------------------------------------------------------------------------

    def add(self, key: str, *, namespace: str, nbytes: int, tokens: int, cost: float, pin: bool) -> None:
        """Index a stored entry (again): its first access now; a pin already set stays."""
        self._rows(
            "INSERT INTO entries (key, namespace, bytes, tokens, cost, hits, last_access, pinned)"
            " VALUES (?, ?, ?, ?, ?, 1, ?, ?) ON CONFLICT(key) DO UPDATE SET"
            " namespace = excluded.namespace, bytes = excluded.bytes, tokens = excluded.tokens,"
            " cost = excluded.cost, last_access = excluded.last_access,"
            " pinned = MAX(pinned, excluded.pinned)",
            (key, namespace, nbytes, tokens, cost, time.time(), int(pin)),
        )

    def touch(self, key: str, now: float) -> None:
        """A read: count it and renew the entry's recency."""
        self._rows("UPDATE entries SET hits = hits + 1, last_access = ? WHERE key = ?", (now, key))

    def pin(self, key: str, pinned: bool) -> bool:
        """Set or clear the entry's pin; whether the index holds ``key``."""
        found = self._rows("SELECT 1 FROM entries WHERE key = ?", (key,))
        self._rows("UPDATE entries SET pinned = ? WHERE key = ?", (int(pinned), key))
        return bool(found)

    def delete(self, keys: Sequence[str]) -> None:
        """Forget ``keys``, in one transaction."""
        if keys:
            self._write_many("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])

    def clear(self) -> None:
        """Forget every entry, of every namespace."""
        self._rows("DELETE FROM entries")

    # -- reads --------------------------------------------------------------------------------

    def totals(self, namespace: str) -> tuple[int, int, int]:
        """``(entries, bytes, pinned entries)`` of one namespace."""
        ((entries, nbytes, pinned),) = self._rows(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0), COALESCE(SUM(pinned), 0) FROM entries"
            " WHERE namespace = ?",
            (namespace,),
        )
        return entries, nbytes, pinned

    def usage(self) -> dict[str, dict[str, int]]:
        """Per namespace: entries, bytes, reads (hits after the first store) and pinned entries."""
        rows = self._rows(
            "SELECT namespace, COUNT(*), SUM(bytes), SUM(hits) - COUNT(*), SUM(pinned)"
            " FROM entries GROUP BY namespace"
        )
        return {ns: {"entries": n, "bytes": b, "reads": r, "pinned": p} for ns, n, b, r, p in rows}

    def keys(self, namespace: str) -> list[str]:
        """Keys of one namespace, or of all when ``namespace == "*"``."""
        sql = "SELECT key FROM entries" + ("" if namespace == "*" else " WHERE namespace = ?")
        return [key for (key,) in self._rows(sql, () if namespace == "*" else (namespace,))]

    def namespaces_by_key(self) -> dict[str, str]:
        """``{key: namespace}`` of every entry."""
        return dict(self._rows("SELECT key, namespace FROM entries"))

    def total_bytes(self) -> int:
        """Payload bytes of every entry, of every namespace."""
        ((total,),) = self._rows("SELECT COALESCE(SUM(bytes), 0) FROM entries")
        return total

    def unpinned(self) -> list[Candidate]:
        """Every entry that eviction may choose."""
        rows = self._rows("SELECT key, bytes, hits, cost, last_access FROM entries WHERE pinned = 0")
        return [Candidate(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._con.close()

    # -- internals ----------------------------------------------------------------------------

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._con.execute(sql, args).fetchall()

    def _write_many(self, sql: str, rows: list[tuple]) -> None:
        with self._lock:
            self._con.execute("BEGIN IMMEDIATE")
            try:
                self._con.executemany(sql, rows)
            except BaseException:
                self._con.execute("ROLLBACK")
                raise
            self._con.execute("COMMIT")
