"""Disk tier (L3): chunk KV in a ``diskcache`` directory, shared by processes and restarts.

- Payloads go through :class:`KVDisk`, a ``diskcache.Disk`` that writes our checked
  raw-buffer format (:mod:`.serialization`) and refuses to pickle anything.
- Eviction metadata (size, recompute cost, hits, last access, pin) lives in a small
  SQLite index beside the payloads, so every process sees the same pins and scores;
  :class:`~.eviction.EvictionPolicy` ranks the entries.
- Writes run on a background thread so the cold path never waits on the disk;
  :meth:`DiskStore.flush` (called by ``close()`` and at exit) waits for them.
- A corrupt or truncated entry is a miss: it is removed, counted and logged. With a store
  secret, entries are signed; an intact entry signed otherwise (another secret, or none) is
  foreign: a miss, counted and logged once, but left for the processes that signed it
  (:class:`~.resilience.ForeignEntries`).
- Files are created private to their owner (``file_mode``, 0600; directories 0700), since
  entries hold prompts as token ids.
- A full disk turns the tier off with a warning; generation carries on from memory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import diskcache

from ..config import check_secret
from ..errors import DamagedStoreError, KVBoostError, StoreError
from .base import Hit, StoredChunk, TierCounters, TierStats
from .codecs import codec_named
from .eviction import Candidate, EvictionPolicy
from .resilience import ForeignEntries, RateLimitedWarnings
from .serialization import (
    CorruptEntryError,
    Entry,
    ForeignEntryError,
    Secrets,
    claimed_owner,
    decode_entry,
    encode,
    secrets_of,
    servable,
)
from .writer import WriteBehindTier

logger = logging.getLogger(__name__)


def directory_mode(file_mode: int) -> int:
    """The mode of directories that hold files of ``file_mode``: search wherever reading is allowed.

    >>> oct(directory_mode(0o600)), oct(directory_mode(0o640))
    ('0o700', '0o750')
    """
    return file_mode | ((file_mode & 0o444) >> 2)


def _restrict(path: Path, mode: int) -> None:
    """Set ``path``'s permission bits; a path of another owner (a shared store) is left as it is."""
    try:
        os.chmod(path, mode)
    except PermissionError:
        logger.debug("cannot change the mode of %s (another owner); left as it is", path)


class KVDisk(diskcache.Disk):
    """diskcache serializer for KV entries: raw buffers with a checked header, never pickle.

    Payload files are created with ``file_mode`` (None: as the umask gives).
    """

    file_mode: int | None = None

    def put(self, key: Any) -> tuple[Any, bool]:
        if not isinstance(key, str):
            raise TypeError(f"kvboost store keys are strings, got {type(key).__name__}")
        return super().put(key)

    def store(self, value: Any, read: bool, key: Any = diskcache.UNKNOWN) -> tuple:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(
                f"kvboost store values are encoded bytes, got {type(value).__name__} (never pickled)"
            )
        if self.file_mode is None or len(value) < self.min_file_size:
            return super().store(bytes(value), read, key)  # small values live in the SQLite row
        filename, full_path = self.filename(key, value)
        _write_new_file(full_path, value, self.file_mode)
        return len(value), diskcache.core.MODE_BINARY, filename, None

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
            except OSError as e:  # not an OSError any more: diskcache would take that for a miss
                raise UnreadablePayloadError(f"payload file {filename} cannot be read ({e})") from e
        raise CorruptEntryError(f"value of storage mode {mode} in a KV store: refused (never unpickled)")


def _write_new_file(path: str, data: bytes | bytearray, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (no moment with wider permissions) and write it.

    Another process may remove the (empty) directory between the two steps, as diskcache does
    when it deletes a directory's last file; like diskcache, try again a few times.
    """
    for attempt in range(10):
        with contextlib.suppress(FileExistsError):
            os.makedirs(os.path.dirname(path), mode=directory_mode(mode))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileNotFoundError:
            if attempt == 9:
                raise
            continue
        with open(fd, "wb") as f:
            f.write(data)
        return


class UnreadablePayloadError(KVBoostError):
    """A payload file exists but cannot be read (permissions, I/O error): a miss, kept as it is."""


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


class DiskStore(WriteBehindTier):
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
        is_new = not (self.directory / "kv" / "cache.db").exists()
        _check_writable(self.directory)
        if file_mode is not None and is_new:
            _restrict(self.directory, directory_mode(file_mode))
            (self.directory / "kv").mkdir(mode=directory_mode(file_mode), exist_ok=True)
            # Created empty with the mode before SQLite opens them; its -wal and -shm files follow it.
            for name in ("kv/cache.db", "index.sqlite"):
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode))
        try:
            self._cache = diskcache.Cache(
                str(self.directory / "kv"),
                disk=KVDisk,
                size_limit=2**62,  # eviction is ours (cost- and pin-aware), not diskcache's
                eviction_policy="none",
                cull_limit=0,
                statistics=False,
                # Every payload in a file of its own, never inside the SQLite file: a damaged
                # database then loses no KV, and `repair` rebuilds it from the files.
                disk_min_file_size=0,
            )
            self._index = _Index(self.directory / "index.sqlite")
        except sqlite3.DatabaseError as e:
            raise DamagedStoreError(self.directory, e) from e
        if file_mode is not None:
            cast(KVDisk, self._cache.disk).file_mode = file_mode
        self._policy = policy or EvictionPolicy()
        self._counters = TierCounters(extra=["corrupt", "foreign", "unreadable"])
        self._warnings = RateLimitedWarnings(logger, warn_every_s)
        self._foreign = ForeignEntries(logger, self.name, self._counters)
        self._disabled_reason: str | None = None
        self._start_writer("kvboost-disk-writer", background=background_writes)

    # -- KVStore -----------------------------------------------------------------------------

    def _read(self, key: str) -> bytearray | None:
        try:
            return self._cache.get(key, default=None, read=True)
        except MissingPayloadError:
            # Another process may have replaced the entry between our row lookup and the
            # file open (the old file is deleted then): look again before calling it corrupt.
            return self._cache.get(key, default=None, read=True)

    def get(self, key: str) -> Hit | None:
        entry: Entry | None = None
        try:
            data = self._read(key)
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
        found = self._index.execute("SELECT 1 FROM entries WHERE key = ?", (key,))
        self._index.execute("UPDATE entries SET pinned = ? WHERE key = ?", (int(pinned), key))
        return bool(found)

    def stats(self) -> dict[str, TierStats]:
        self.flush()
        s = self._counters.snapshot()
        ((entries, nbytes, pinned),) = self._index.execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0), COALESCE(SUM(pinned), 0) FROM entries"
            " WHERE namespace = ?",
            (self.namespace,),
        )
        s.entries, s.bytes, s.pinned = entries, nbytes, pinned
        return {self.name: s}

    def remove(self, key: str) -> bool:
        self.flush()
        self._index.execute("DELETE FROM entries WHERE key = ?", (key,))
        return bool(self._cache.delete(key))

    def clear(self) -> None:
        """Delete every entry in the directory, of every namespace."""
        self.flush()
        self._cache.clear()
        self._index.execute("DELETE FROM entries")

    # -- maintenance -------------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, int]]:
        """Per namespace: entries, bytes, reads (hits after the first store) and pinned entries."""
        self.flush()
        rows = self._index.execute(
            "SELECT namespace, COUNT(*), SUM(bytes), SUM(hits) - COUNT(*), SUM(pinned)"
            " FROM entries GROUP BY namespace"
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

    def read_checked(self, key: str, namespace: str) -> StoredChunk:
        """Read and check one entry of any namespace; raises :class:`CorruptEntryError` or
        :class:`ForeignEntryError`."""
        data = self._read(key)
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
        return dict(self._index.execute("SELECT key, namespace FROM entries"))

    def reindex(self, key: str) -> str:
        """Check an entry that the index lost and index it again (under the namespace its checked
        header names); returns that namespace. Raises :class:`CorruptEntryError`."""
        data = self._read(key)
        if data is None:
            raise CorruptEntryError("no payload")
        namespace, claimed = claimed_owner(data)
        if claimed != key:
            raise CorruptEntryError("entry belongs to another key")
        # intact is enough to index it (a foreign entry is evicted in time; it is never served)
        entry = decode_entry(data, namespace, key, check_signature=False)
        self._add_row(key, namespace, len(data), entry.chunk.num_tokens, entry.cost or 1.0, pin=False)
        return namespace

    def remove_orphans(self, min_age_s: float = 60.0) -> int:
        """Delete index rows without a payload, and payload files that no entry names (older than
        ``min_age_s``: a concurrent write creates its file just before its row); returns how many."""
        self.flush()
        stored = set(self.stored_keys())
        rows = [key for key in self.indexed_namespaces() if key not in stored]
        if rows:
            self._index.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in rows])
        cutoff = time.time() - min_age_s
        files = [p for p in self.unnamed_files() if p.stat().st_mtime < cutoff]
        for path in files:
            path.unlink(missing_ok=True)
        return len(rows) + len(files)

    def unnamed_files(self) -> list[Path]:
        """Payload files under the directory that no entry of the payload database names."""
        root = self.directory / "kv"
        # diskcache keeps each entry's file name in its SQLite table ``Cache``; read it directly,
        # read-only, since diskcache offers no call that lists them.
        con = sqlite3.connect(f"file:{root / 'cache.db'}?mode=ro", uri=True, timeout=60)
        try:
            named = {name for (name,) in con.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
        finally:
            con.close()
        return [p for p in root.glob("*/*/*.val") if str(p.relative_to(root)) not in named]

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
        self._add_row(key, namespace, len(data), entry.chunk.num_tokens, entry.cost or 1.0, pin=False)
        path.unlink()
        return key

    def evict_to(self, max_bytes: int) -> int:
        """Evict unpinned entries, lowest score first, until the directory holds ``max_bytes``."""
        ((total,),) = self._index.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries")
        if total <= max_bytes:
            return 0
        rows = self._index.execute("SELECT key, bytes, hits, cost, last_access FROM entries WHERE pinned = 0")
        candidates = [Candidate(*row) for row in rows]
        doomed = self._policy.choose_victims(candidates, free_bytes=total - max_bytes, now=time.time())
        self._delete(doomed)
        self._counters.add("evictions", len(doomed))
        return len(doomed)

    # -- internals ---------------------------------------------------------------------------

    def _release(self) -> None:
        self._cache.close()
        self._index.close()

    def _touch(self, key: str, now: float) -> None:
        """A read: count it and renew the entry's recency (a queued write)."""
        self._index.execute("UPDATE entries SET hits = hits + 1, last_access = ? WHERE key = ?", (now, key))

    def _write(self, key: str, chunk: StoredChunk, cost: float, pin: bool) -> None:
        """Store one entry, then evict down to ``max_bytes`` (a queued write)."""
        if self._disabled_reason is not None or key in self._foreign:
            return
        try:
            data = encode(chunk, self.namespace, key, cost, secret=self.secrets, codec=self.codec)
            self._cache.set(key, data)
            self._add_row(key, self.namespace, len(data), chunk.num_tokens, cost, pin)
        except (OSError, sqlite3.OperationalError) as e:
            if _is_disk_full(e):
                self._disabled_reason = str(e)
                self._warnings.warn("full", "disk tier is full (%s); continuing with the memory tier only", e)
                return
            raise
        self._counters.add("puts")
        if self.max_bytes is not None:
            self.evict_to(self.max_bytes)

    def _add_row(self, key: str, namespace: str, nbytes: int, tokens: int, cost: float, pin: bool) -> None:
        self._index.execute(
            "INSERT INTO entries (key, namespace, bytes, tokens, cost, hits, last_access, pinned)"
            " VALUES (?, ?, ?, ?, ?, 1, ?, ?) ON CONFLICT(key) DO UPDATE SET"
            " namespace = excluded.namespace, bytes = excluded.bytes, tokens = excluded.tokens,"
            " cost = excluded.cost, last_access = excluded.last_access,"
            " pinned = MAX(pinned, excluded.pinned)",
            (key, namespace, nbytes, tokens, cost, time.time(), int(pin)),
        )

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self._cache.delete(key)
        if keys:
            self._index.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])

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
