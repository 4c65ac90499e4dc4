"""The disk tier's files: the directory layout, private file modes, and the payload files.

- Payloads go through :class:`KVDisk`, a ``diskcache.Disk`` that writes our checked raw-buffer
  format (:mod:`.serialization`) and refuses to pickle anything; diskcache keeps its key -> file
  table in :data:`PAYLOAD_DB`.
- Files are created private to their owner (``file_mode``, 0600; directories 0700), since
  entries hold prompts as token ids.
- A payload file that cannot be read is told apart from a damaged one: it is kept
  (:class:`UnreadablePayloadError`), while a damaged one is removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any, cast

import diskcache

from ..errors import KVBoostError, StoreError
from .serialization import CorruptEntryError

logger = logging.getLogger(__name__)

PAYLOAD_DIR = "kv"
"""diskcache's directory, relative to the store directory: its table and the payload files."""
PAYLOAD_DB = f"{PAYLOAD_DIR}/cache.db"
"""diskcache's key -> payload file table (SQLite)."""
INDEX_DB = "index.sqlite"
"""The eviction index (SQLite, :mod:`.disk_index`)."""


def directory_mode(file_mode: int) -> int:
    """The mode of directories that hold files of ``file_mode``: search wherever reading is allowed.

    >>> oct(directory_mode(0o600)), oct(directory_mode(0o640))
    ('0o700', '0o750')
    """
    return file_mode | ((file_mode & 0o444) >> 2)


def prepare_directory(directory: Path, file_mode: int | None) -> None:
    """Create ``directory`` (refused when it cannot be written); a new store gets ``file_mode`` from
    the start, on the directory and on the SQLite files before SQLite opens them."""
    is_new = not (directory / PAYLOAD_DB).exists()
    _check_writable(directory)
    if file_mode is not None and is_new:
        _restrict(directory, directory_mode(file_mode))
        (directory / PAYLOAD_DIR).mkdir(mode=directory_mode(file_mode), exist_ok=True)
        # Created empty with the mode before SQLite opens them; its -wal and -shm files follow it.
        for name in (PAYLOAD_DB, INDEX_DB):
            with contextlib.suppress(FileExistsError):
                os.close(os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode))


def open_payloads(directory: Path, file_mode: int | None) -> diskcache.Cache:
    """diskcache over ``directory``'s payload files, writing them with ``file_mode``."""
    cache = diskcache.Cache(
        str(directory / PAYLOAD_DIR),
        disk=KVDisk,
        size_limit=2**62,  # eviction is ours (cost- and pin-aware), not diskcache's
        eviction_policy="none",
        cull_limit=0,
        statistics=False,
        # Every payload in a file of its own, never inside the SQLite file: a damaged
        # database then loses no KV, and `repair` rebuilds it from the files.
        disk_min_file_size=0,
    )
    if file_mode is not None:
        cast(KVDisk, cache.disk).file_mode = file_mode
    return cache


def read_payload(cache: diskcache.Cache, key: str) -> bytearray | None:
    """The payload stored under ``key``, or None."""
    try:
        return cache.get(key, default=None, read=True)
    except MissingPayloadError:
        # Another process may have replaced the entry between our row lookup and the
        # file open (the old file is deleted then): look again before calling it corrupt.
        return cache.get(key, default=None, read=True)


def unnamed_files(directory: Path) -> list[Path]:
    """Payload files under ``directory`` that no entry of the payload database names."""
    root = directory / PAYLOAD_DIR
    # diskcache keeps each entry's file name in its SQLite table ``Cache``; read it directly,
    # read-only, since diskcache offers no call that lists them.
    con = sqlite3.connect(f"file:{directory / PAYLOAD_DB}?mode=ro", uri=True, timeout=60)
    try:
        named = {name for (name,) in con.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    finally:
        con.close()
    return [p for p in root.glob("*/*/*.val") if str(p.relative_to(root)) not in named]


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


class UnreadablePayloadError(KVBoostError):
    """A payload file exists but cannot be read (permissions, I/O error): a miss, kept as it is."""


class MissingPayloadError(CorruptEntryError):
    """The row names a payload file that is gone (deleted, or replaced by a concurrent write)."""


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


def _restrict(path: Path, mode: int) -> None:
    """Set ``path``'s permission bits; a path of another owner (a shared store) is left as it is."""
    try:
        os.chmod(path, mode)
    except PermissionError:
        logger.debug("cannot change the mode of %s (another owner); left as it is", path)


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
