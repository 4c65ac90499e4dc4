"""Document registry: find pre-warmed documents inside flat prompts.

Frameworks often hand the model one string with the retrieved documents pasted
in. Pre-warming registers each document's canonical text; at query time the
registry finds registered documents inside a text and splits it so that each
document becomes its own segment, exactly as it was pre-warmed.

Matching is exact: only identical canonical text matches. Each document is
indexed by its first :data:`ANCHOR_CHARS` characters; a prompt is scanned once,
one dictionary probe per position, and every anchor hit is confirmed with a
full comparison. Documents shorter than the anchor are not found in flat text
(pass them as explicit segments instead).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

ANCHOR_CHARS = 32


class Match(NamedTuple):
    start: int
    end: int


class DocumentRegistry:
    """Registered document texts, in memory and (with ``path``) persisted in SQLite.

    >>> reg = DocumentRegistry()
    >>> doc = "Paris is the capital of France. It lies on the Seine."
    >>> reg.register([doc])
    1
    >>> text = "Context: " + doc + " Question?"
    >>> [text[m.start:m.end] == doc for m in reg.find(text)]
    [True]
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self._anchors: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._con: sqlite3.Connection | None = None
        self._seen_rowid = 0
        if path is not None:
            self._con = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
            self._con.execute("PRAGMA journal_mode=WAL")
            self._con.execute("CREATE TABLE IF NOT EXISTS documents (text TEXT PRIMARY KEY)")
            self._refresh()

    def __len__(self) -> int:
        self._refresh()
        return sum(len(v) for v in self._anchors.values())

    def register(self, texts: Iterable[str]) -> int:
        """Add canonical (normalized) document texts; returns how many were new."""
        self._refresh()
        new = [t for t in dict.fromkeys(texts) if len(t) >= ANCHOR_CHARS and not self._known(t)]
        if self._con is not None and new:
            with self._lock:
                self._con.execute("BEGIN IMMEDIATE")
                self._con.executemany("INSERT OR IGNORE INTO documents (text) VALUES (?)", [(t,) for t in new])
                self._con.execute("COMMIT")
            self._refresh()
        else:
            with self._lock:
                for t in new:
                    self._anchors.setdefault(t[:ANCHOR_CHARS], []).append(t)
        return len(new)

    def find(self, text: str) -> list[Match]:
        """Non-overlapping registered documents in ``text``, leftmost first, longest at a position."""
        self._refresh()
        anchors = self._anchors
        if not anchors or len(text) < ANCHOR_CHARS:
            return []
        matches = []
        i, last = 0, len(text) - ANCHOR_CHARS
        while i <= last:
            candidates = anchors.get(text[i : i + ANCHOR_CHARS])
            if candidates:
                best = max((c for c in candidates if text.startswith(c, i)), key=len, default=None)
                if best is not None:
                    matches.append(Match(i, i + len(best)))
                    i += len(best)
                    continue
            i += 1
        return matches

    def _known(self, text: str) -> bool:
        return text in self._anchors.get(text[:ANCHOR_CHARS], ())

    def _refresh(self) -> None:
        """Load documents registered since the last look (by this or another process)."""
        if self._con is None:
            return
        with self._lock:
            rows = self._con.execute(
                "SELECT rowid, text FROM documents WHERE rowid > ? ORDER BY rowid", (self._seen_rowid,)
            ).fetchall()
            for rowid, text in rows:
                bucket = self._anchors.setdefault(text[:ANCHOR_CHARS], [])
                if text not in bucket:
                    bucket.append(text)
                self._seen_rowid = rowid

    def close(self) -> None:
        if self._con is not None:
            with self._lock:
                self._con.close()
            self._con = None
