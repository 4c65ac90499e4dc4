"""Disk tier (L3): chunk KV in a ``diskcache`` directory, shared by processes and restarts.

- Payloads are files of our checked raw-buffer format, never pickled, created private to their
  owner (:mod:`.disk_files`).
- Eviction metadata (size, recompute cost, hits, last access, pin) lives in a small
  SQLite index beside the payloads, so every process sees the same pins and scores
  (:mod:`.disk_index`); :class:`~.eviction.EvictionPolicy` ranks the entries.
- Writes run on a background thread so the cold path never waits on the disk;
  :meth:`DiskStore.flush` (called by ``close()`` and at exit) waits for them.
- A corrupt or truncated entry is a miss: it is removed, counted and logged. With a store
  secret, entries are signed; an intact entry signed otherwise (another secret, or none) is
  foreign: a miss, counted and logged once, but left for the processes that signed it
  (:class:`~.resilience.ForeignEntries`).
- A full disk turns the tier off with a warning; generation carries on from memory.
- The payloads and the index are settled with each other by :mod:`.disk_repair`.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from ..config import check_secret
from ..errors import DamagedStoreError
from .base import Hit, StoredChunk, TierCounters, TierStats
from .codecs import codec_named
from .disk_files import (
    INDEX_DB,
    KVDisk,
    UnreadablePayloadError,
    open_payloads,
    prepare_directory,
    read_payload,
)
from .disk_index import DiskIndex
from .disk_repair import DiskRepair
from .eviction import EvictionPolicy
from .resilience import ForeignEntries, RateLimitedWarnings
from .serialization import (
    CorruptEntryError,
    Entry,
    ForeignEntryError,
    Secrets,
    decode_entry,
    encode,
    secrets_of,
    servable,
)
from .writer import WriteBehindTier

__all__ = ["DiskStore", "KVDisk", "UnreadablePayloadError"]

logger = logging.getLogger(__name__)


class DiskStore(WriteBehindTier, DiskRepair):
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
        policy: EvictionPolicy | None = None,
        warn_every_s: float = 0.0,
        secret: Secrets = None,
        file_mode: int | None = 0o600,
        codec: str = "raw",
    ) -> None:
        """
        Args:
            directory: the store directory (created if missing); processes may share it.
            namespace: the engine's store namespace (model, tokenizer, dtype, layout).
            max_bytes: payload budget of the whole directory; ``None``: no budget.
            background_writes: ``False`` writes synchronously (tests, tools).
            policy: which entries go first when over ``max_bytes``.
            warn_every_s: at most one warning per kind of problem in this period; 0 (the default):
                each problem is logged (a disk fails rarely, and each unusable entry is worth a line).
            secret: store secret: entries are signed with it, and read only when signed with it;
                several during a rotation (the first signs, any of them verifies).
            file_mode: permission bits of the files the tier creates (directories: the same
                plus search bits); 0o640 or 0o660 to share with a group; None: the umask's.
            codec: how entries are written (:mod:`.codecs`); entries of every codec are read, those
                of an approximate one only when ``codec`` is approximate too.
        """
        self.directory = Path(directory).expanduser()
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.secrets = tuple(check_secret(s) for s in secrets_of(secret))
        self.codec = codec_named(codec)
        prepare_directory(self.directory, file_mode)
        try:
            self._cache = open_payloads(self.directory, file_mode)
            self._index = DiskIndex(self.directory / INDEX_DB)
        except sqlite3.DatabaseError as e:
            raise DamagedStoreError(self.directory, e) from e
        self._policy = policy or EvictionPolicy()
        self._counters = TierCounters(extra=["corrupt", "foreign", "unreadable"])
        self._warnings = RateLimitedWarnings(logger, warn_every_s)
        self._foreign = ForeignEntries(logger, self.name, self._counters)
        self._disabled_reason: str | None = None
        self._start_writer("kvboost-disk-writer", background=background_writes)

    # -- KVStore -----------------------------------------------------------------------------

    def get(self, key: str) -> Hit | None:
        entry: Entry | None = None
        try:
            data = read_payload(self._cache, key)
            entry = None if data is None else decode_entry(data, self.namespace, key, secret=self.secrets)
            entry = servable(entry, self.codec)
        except CorruptEntryError as e:
            self._drop_corrupt(key, str(e))
        except ForeignEntryError as e:
            self._foreign.seen(key, str(e))
        except (OSError, sqlite3.Error, UnreadablePayloadError) as e:
            self._counters.add("unreadable")
            self._warnings.warn(
                "read",
                "disk tier read failed for %s… (%s); treating it as a miss (check the store's file "
                "permissions and disk; 'kvboost-rag verify' lists unreadable entries)",
                key[:12],
                e,
            )
        self._counters.read(found=entry is not None)
        if entry is None:
            return None
        self._writer.submit(partial(self._touch, key, time.time()))
        return Hit(entry.chunk, self.name, entry.cost)

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        if self._disabled_reason is None:
            self._writer.submit(partial(self._write, key, chunk, cost, pin))

    def contains(self, key: str) -> bool:
        return key in self._cache

    def pin(self, key: str, pinned: bool = True) -> bool:
        self.flush()
        return self._index.pin(key, pinned)

    def stats(self) -> dict[str, TierStats]:
        self.flush()
        s = self._counters.snapshot()
        s.entries, s.bytes, s.pinned = self._index.totals(self.namespace)
        return {self.name: s}

    def remove(self, key: str) -> bool:
        self.flush()
        self._index.delete([key])
        return bool(self._cache.delete(key))

    def clear(self) -> None:
        """Delete every entry in the directory, of every namespace."""
        self.flush()
        self._cache.clear()
        self._index.clear()

    # -- stats, gc and eviction (repair: :class:`~.disk_repair.DiskRepair`) -------------------

    def usage(self) -> dict[str, dict[str, int]]:
        """Per namespace: entries, bytes, reads (hits after the first store) and pinned entries."""
        self.flush()
        return self._index.usage()

    def namespaces(self) -> dict[str, tuple[int, int]]:
        """``{namespace: (entries, bytes)}`` over the whole directory."""
        return {ns: (u["entries"], u["bytes"]) for ns, u in self.usage().items()}

    def keys(self, namespace: str | None = None) -> Iterator[str]:
        """Keys of one namespace (default: this store's), or of all when ``namespace == "*"``."""
        self.flush()
        yield from self._index.keys(self.namespace if namespace is None else namespace)

    def drop_namespaces(self, keep: set[str]) -> int:
        """Delete every entry whose namespace is not in ``keep``; returns how many."""
        self.flush()
        doomed = [key for key, ns in self._index.namespaces_by_key().items() if ns not in keep]
        self._delete(doomed)
        return len(doomed)

    def evict_to(self, max_bytes: int) -> int:
        """Evict unpinned entries, lowest score first, until the directory holds ``max_bytes``."""
        total = self._index.total_bytes()
        if total <= max_bytes:
            return 0
        doomed = self._policy.choose_victims(
            self._index.unpinned(), free_bytes=total - max_bytes, now=time.time()
        )
        self._delete(doomed)
        self._counters.add("evictions", len(doomed))
        return len(doomed)

    # -- internals ---------------------------------------------------------------------------

    def _release(self) -> None:
        self._cache.close()
        self._index.close()

    def _touch(self, key: str, now: float) -> None:
        """A read: count it and renew the entry's recency (a queued write)."""
        self._index.touch(key, now)

    def _write(self, key: str, chunk: StoredChunk, cost: float, pin: bool) -> None:
        """Store one entry, then evict down to ``max_bytes`` (a queued write)."""
        if self._disabled_reason is not None or key in self._foreign:
            return
        try:
            data = encode(chunk, self.namespace, key, cost, secret=self.secrets, codec=self.codec)
            self._cache.set(key, data)
            self._index.add(
                key, namespace=self.namespace, nbytes=len(data), tokens=chunk.num_tokens, cost=cost, pin=pin
            )
        except (OSError, sqlite3.OperationalError) as e:
            if _is_disk_full(e):
                self._disabled_reason = str(e)
                self._warnings.warn("full", "disk tier is full (%s); continuing with the memory tier only", e)
                return
            raise
        self._counters.add("puts")
        if self.max_bytes is not None:
            self.evict_to(self.max_bytes)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self._cache.delete(key)
        self._index.delete(keys)

    def _drop_corrupt(self, key: str, reason: str) -> None:
        self._warnings.unusable_entry(self.name, key, reason)
        self._counters.add("corrupt")
        try:
            self._delete([key])
        except (OSError, sqlite3.Error) as e:
            self._warnings.warn("remove", "could not remove corrupt entry %s… (%s)", key[:12], e)

    @property
    def disabled_reason(self) -> str | None:
        """Why the tier stopped writing (a full disk), or None."""
        return self._disabled_reason


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, sqlite3.OperationalError) and "full" in str(e).lower()
