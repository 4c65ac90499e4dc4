"""Store maintenance: integrity scans, bitwise recompute checks, and repair of a damaged store.

A disk store is three SQLite files beside the payload files: ``kv/cache.db`` (diskcache's
key -> file table), ``index.sqlite`` (eviction metadata) and ``documents.sqlite`` (the
document registry). Every payload carries its own namespace and key in a checked header,
so a store whose databases are lost or damaged can be rebuilt from its payloads alone.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .keys import Chunk
from .registry import REGISTRY_DB, DocumentRegistry
from .runner import prefill
from .store import CorruptEntryError, DiskStore
from .store.codecs import codec_named
from .store.disk import UnreadablePayloadError
from .store.disk_files import INDEX_DB, PAYLOAD_DB
from .store.serialization import ForeignEntryError, Secrets

if TYPE_CHECKING:
    from .engine import KVBoostEngine

logger = logging.getLogger(__name__)

DATABASES = (PAYLOAD_DB, INDEX_DB, REGISTRY_DB)
"""The store's SQLite files, relative to its directory."""


@dataclass
class VerifyReport:
    checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    """Keys whose entry failed a check, or a bitwise recompute (they are removed)."""
    foreign: list[str] = field(default_factory=list)
    """Keys of intact entries signed otherwise than the scan's secrets sign (kept: another process
    may hold their secret; :func:`drop_foreign` removes them)."""
    unreadable: list[str] = field(default_factory=list)
    """Keys whose payload could not be read (file permissions, I/O errors); kept as they are."""
    reindexed: int = 0
    """Entries the eviction index had lost, checked and indexed again."""
    orphans: int = 0
    """Index rows without a payload and payload files of no entry, removed."""
    recomputed: int = 0
    mismatched: list[str] = field(default_factory=list)
    """Keys whose stored KV differed from a fresh recompute (they are removed)."""
    unverifiable: int = 0
    """Sampled entries whose chain of parents is no longer complete."""

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.mismatched and not self.unreadable


def scan(store: DiskStore, *, orphan_age_s: float = 60.0) -> VerifyReport:
    """Read and check every entry of every namespace (checksum, signature, shape, dtype, key).

    Corrupt entries are removed; foreign ones (intact, signed otherwise) are counted and kept;
    entries the index lost are indexed again; index rows without a payload and payload files
    that no entry names (older than ``orphan_age_s``) are removed.
    """
    report = VerifyReport(orphans=store.remove_orphans(orphan_age_s))
    indexed = store.indexed_namespaces()
    for key in store.stored_keys():
        report.checked += 1
        try:
            if key in indexed:
                store.read_checked(key, indexed[key])
            else:
                store.reindex(key)
                report.reindexed += 1
        except CorruptEntryError:
            report.corrupt.append(key)
            store.remove(key)
        except ForeignEntryError:
            report.foreign.append(key)
        except (OSError, UnreadablePayloadError) as e:
            logger.warning("entry %s… cannot be read (%s); check the store's file permissions", key[:12], e)
            report.unreadable.append(key)
    return report


def recompute_sample(engine: KVBoostEngine, store: DiskStore, sample: int, seed: int = 0) -> VerifyReport:
    """Recompute ``sample`` random entries of the engine's namespace and compare them bitwise (an
    entry of a lossy codec with what that codec makes of the recomputed KV); an entry that differs
    is removed (it would be served as what it is not)."""
    report = VerifyReport()
    keys = list(store.keys(engine.namespace))
    for key in random.Random(seed).sample(keys, min(sample, len(keys))):
        chain = _chain(store, key, engine.namespace)
        if chain is None:
            report.unverifiable += 1
            continue
        token_ids: list[int] = []
        chunks: list[Chunk] = []
        for chunk_key, ids in chain:
            chunks.append(Chunk(len(token_ids), len(token_ids) + len(ids), chunk_key))
            token_ids.extend(ids)
        out = prefill(engine.assembler, token_ids, chunks, store=None, capacity=len(token_ids))
        fresh = engine.assembler.extract(out.cache, chunks[-1].start, chunks[-1].end)
        stored = store.read_checked(key, engine.namespace)
        codec = codec_named(stored.codec)
        if codec.approximate:  # quantizing is deterministic: the same KV gives the same codes
            fresh = codec.decode(b"".join(codec.encode(fresh)), fresh.shape, fresh.dtype)
        report.recomputed += 1
        if not torch.equal(fresh.cpu(), stored.kv):
            report.mismatched.append(key)
            store.remove(key)
    return report


def _chain(store: DiskStore, key: str, namespace: str) -> list[tuple[str, tuple[int, ...]]] | None:
    """``[(key, token_ids), ...]`` from the first chunk of the prompt down to ``key``."""
    chain = []
    current: str | None = key
    while current is not None:
        try:
            entry = store.read_checked(current, namespace)
        except (CorruptEntryError, ForeignEntryError):
            return None
        if entry.token_ids is None:
            return None
        chain.append((current, entry.token_ids))
        current = entry.parent_key
    return chain[::-1]


@dataclass
class RepairReport:
    set_aside: list[str] = field(default_factory=list)
    """Damaged databases, renamed to ``<name>.damaged-<time>`` and rebuilt."""
    adopted: int = 0
    """Payload files indexed again from their own headers (after ``kv/cache.db`` was rebuilt)."""
    refused: int = 0
    """Payload files of no entry that failed their checks (removed)."""
    scan: VerifyReport = field(default_factory=VerifyReport)


def damaged_databases(directory: Path) -> list[str]:
    """The store's SQLite files that cannot be opened or fail SQLite's own check."""
    damaged = []
    for name in DATABASES:
        path = directory / name
        if not path.exists():
            continue
        try:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
            try:
                ok = con.execute("PRAGMA quick_check").fetchone() == ("ok",)
            finally:
                con.close()
        except sqlite3.DatabaseError:
            ok = False
        if not ok:
            damaged.append(name)
    return damaged


def drop_foreign(store: DiskStore) -> int:
    """Remove every intact entry signed otherwise than ``store``'s secrets sign (on purpose: the
    processes that wrote them lose them); returns how many."""
    indexed = store.indexed_namespaces()
    doomed = []
    for key, namespace in indexed.items():
        try:
            store.read_checked(key, namespace)
        except ForeignEntryError:
            doomed.append(key)
        except (CorruptEntryError, OSError, UnreadablePayloadError):
            continue  # damage is for scan()
    for key in doomed:
        store.remove(key)
    return len(doomed)


def repair(directory: str | Path, *, secret: Secrets = None) -> RepairReport:
    """Rebuild a store whose databases are damaged, keeping every payload that still checks.

    Damaged databases are set aside (renamed, never deleted) and made anew; payload files
    that no entry names are stored again under the key their checked header names; then
    :func:`scan` re-indexes what the eviction index lost and removes what is corrupt. Run it
    while no other process uses the store. A rebuilt ``documents.sqlite`` starts empty:
    pre-warm the documents again for blend mode to find them.
    """
    directory = Path(directory).expanduser()
    report = RepairReport()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in damaged_databases(directory):
        for suffix in ("", "-wal", "-shm"):
            path = directory / f"{name}{suffix}"
            if path.exists():
                path.rename(path.with_name(f"{path.name}.damaged-{stamp}"))
        report.set_aside.append(name)
    store = DiskStore(directory, namespace="", background_writes=False, secret=secret)
    try:
        for path in store.unnamed_files():
            try:
                store.adopt(path)
                report.adopted += 1
            except CorruptEntryError:
                path.unlink(missing_ok=True)
                report.refused += 1
        report.scan = scan(store, orphan_age_s=0.0)
    finally:
        store.close()
    DocumentRegistry(directory / REGISTRY_DB).close()  # makes a set-aside registry anew
    return report
