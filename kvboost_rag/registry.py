"""Document registry: the pre-warmed documents, and where blend finds their passages.

Pre-warming registers each document's canonical text; the engine's stats and the CLI count them.
Documents shorter than :data:`MIN_DOCUMENT_CHARS` are not registered (a phrase, not a document).

For blend reuse the registry also keeps *sources*: for the content key of each
stored document chunk, the prefix key it is stored under and the position it
was computed at, so a document can be found wherever it appears.

Processes that share only a remote tier (Redis), not a store directory, share
the registry through it as well: pass the store's records (``store.shared_records()``)
as ``shared`` (see :class:`SharedRecords`). Shared records are best effort: when the remote side
is away, each process keeps what it has and learns the rest later.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from .errors import DamagedStoreError

REGISTRY_DB = "documents.sqlite"
"""The registry's SQLite file in a store directory."""
MIN_DOCUMENT_CHARS = 32
"""Texts shorter than this are not registered as documents."""
LOOKUP_BATCH = 500
"""Content keys per SQLite query (under SQLite's bound on query parameters)."""


class Source(NamedTuple):
    """Where the KV of a document chunk is stored, and the position its keys were rotated for."""

    prefix_key: str
    start: int


class SharedRecords(Protocol):
    """Registry records kept where other processes see them (implemented by the Redis tier).

    Every method must be quick and must not raise when the shared side is unavailable.
    """

    def publish_documents(self, texts: Sequence[str]) -> None: ...

    def new_documents(self) -> list[str]:
        """Documents published by any process since the last call."""
        ...

    def publish_sources(self, sources: Mapping[str, Source]) -> None: ...

    def sources(self, content_keys: Sequence[str]) -> dict[str, Source]:
        """The recorded locations of those ``content_keys`` that are known (empty while away)."""
        ...


class DocumentRegistry:
    """Registered document texts and chunk sources, in memory and (with ``path``) persisted in SQLite.

    >>> reg = DocumentRegistry()
    >>> reg.register(["Paris is the capital of France. It lies on the Seine."] * 2)
    1
    >>> len(reg)
    1
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        shared: SharedRecords | None = None,
        file_mode: int | None = None,
    ) -> None:
        """``path``: the SQLite file (None: memory only), created with ``file_mode`` (None: the umask's);
        a damaged one raises :class:`~kvboost_rag.errors.DamagedStoreError`."""
        self._documents: set[str] = set()
        self._shared = shared
        self._sources: dict[str, Source] = {}
        self._lock = threading.Lock()
        self._con: sqlite3.Connection | None = None
        self._seen_rowid = 0
        if path is not None:
            path = Path(path)
            if file_mode is not None:  # created empty with the mode: SQLite's -wal and -shm follow it
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode))
            try:
                self._con = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
                self._con.execute("PRAGMA journal_mode=WAL")
                self._con.execute("CREATE TABLE IF NOT EXISTS documents (text TEXT PRIMARY KEY)")
                self._con.execute(
                    "CREATE TABLE IF NOT EXISTS sources"
                    " (content_key TEXT PRIMARY KEY, prefix_key TEXT, start INTEGER)"
                )
                self._refresh()
            except sqlite3.DatabaseError as e:
                if self._con is not None:
                    self._con.close()
                raise DamagedStoreError(path.parent, e) from e

    def __len__(self) -> int:
        self._refresh()
        return len(self._documents)

    def register(self, texts: Iterable[str]) -> int:
        """Add canonical (normalized) document texts; returns how many were new."""
        self._refresh()
        texts = [t for t in dict.fromkeys(texts) if len(t) >= MIN_DOCUMENT_CHARS]
        if self._shared is not None:
            self._shared.publish_documents(texts)  # all of them: the shared side may have lost some
        new = [t for t in texts if t not in self._documents]
        if self._con is not None and new:
            with self._lock:
                self._con.execute("BEGIN IMMEDIATE")
                self._con.executemany(
                    "INSERT OR IGNORE INTO documents (text) VALUES (?)", [(t,) for t in new]
                )
                self._con.execute("COMMIT")
            self._refresh()
        else:
            with self._lock:
                self._documents.update(new)
        return len(new)

    def add_sources(self, sources: dict[str, Source]) -> None:
        """Record where document chunks are stored, by content key (the latest record wins)."""
        if not sources:
            return
        with self._lock:
            self._sources.update(sources)
            if self._con is not None:
                self._con.execute("BEGIN IMMEDIATE")
                self._con.executemany(
                    "INSERT OR REPLACE INTO sources (content_key, prefix_key, start) VALUES (?, ?, ?)",
                    [(k, s.prefix_key, s.start) for k, s in sources.items()],
                )
                self._con.execute("COMMIT")
        if self._shared is not None:
            self._shared.publish_sources(sources)

    def may_have_sources(self) -> bool:
        """False only while no process can have recorded a source (a quick check, before a search)."""
        if self._shared is not None or self._sources:
            return True
        if self._con is None:
            return False
        with self._lock:
            return self._con.execute("SELECT 1 FROM sources LIMIT 1").fetchone() is not None

    def source(self, content_key: str) -> Source | None:
        """The stored location of a document chunk with this content key, if any process recorded one."""
        return self.sources([content_key]).get(content_key)

    def sources(self, content_keys: Sequence[str]) -> dict[str, Source]:
        """The recorded locations of those ``content_keys`` that any process recorded (one query per
        :data:`LOOKUP_BATCH` keys, and one remote call for the rest)."""
        with self._lock:
            found = {k: s for k in content_keys if (s := self._sources.get(k)) is not None}
            missing = [k for k in content_keys if k not in found]
            if self._con is not None:
                for i in range(0, len(missing), LOOKUP_BATCH):
                    batch = missing[i : i + LOOKUP_BATCH]
                    rows = self._con.execute(
                        "SELECT content_key, prefix_key, start FROM sources WHERE content_key IN"
                        f" ({','.join('?' * len(batch))})",
                        batch,
                    ).fetchall()
                    for key, prefix_key, start in rows:
                        found[key] = self._sources[key] = Source(prefix_key, int(start))
                missing = [k for k in missing if k not in found]
        if missing and self._shared is not None:
            remote = self._shared.sources(missing)  # outside the lock: a remote call
            if remote:
                with self._lock:
                    self._sources.update(remote)
                found |= remote
        return found

    def _refresh(self) -> None:
        """Load documents registered since the last look (by this or another process)."""
        if self._shared is not None:
            remote = [t for t in self._shared.new_documents() if len(t) >= MIN_DOCUMENT_CHARS]
            if remote:
                with self._lock:
                    self._documents.update(remote)
        if self._con is None:
            return
        with self._lock:
            rows = self._con.execute(
                "SELECT rowid, text FROM documents WHERE rowid > ? ORDER BY rowid", (self._seen_rowid,)
            ).fetchall()
            for rowid, text in rows:
                self._documents.add(text)
                self._seen_rowid = rowid

    def close(self) -> None:
        if self._con is not None:
            with self._lock:
                self._con.close()
            self._con = None
