"""Disk tier: round trips, persistence, corruption as a miss, no pickle, eviction, maintenance, errors."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from pathlib import Path

import diskcache
import pytest
import torch
from helpers import assert_same_chunk

from kvboost_rag.errors import StoreError
from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.disk import DiskStore, KVDisk
from kvboost_rag.store.serialization import CorruptEntryError, encode

NS = "model-a|tok|float32|v1"
LOGGER = "kvboost_rag.store.disk"
BIG_TOKENS = 128  # [2, 2, 2, 128, 32] float32 = 128 KiB


def key(i) -> str:
    """A prefix-key-like string: fixed length (one shape, one entry size), distinct in its first 12 chars."""
    return f"k{i:03d}".ljust(64, "0")


def chunk(tokens=4, fill=None, dtype=torch.float32, logits=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, 2, tokens, 32)
    kv = torch.randn(shape, generator=g).to(dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return StoredChunk(kv, torch.randn(50, generator=g) if logits else None)


def disk_stats(store):
    return store.stats()["disk"]


def entry_bytes(k, c, namespace=NS) -> int:
    return len(encode(c, namespace, k))


@pytest.fixture
def store_dir(tmp_path):
    yield tmp_path / "store"


@pytest.fixture
def store(store_dir):
    s = DiskStore(store_dir, namespace=NS)
    yield s
    s.close()


def val_files(directory: Path) -> list[Path]:
    return sorted((directory / "kv").rglob("*.val"))


# -- basic operations --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [4, BIG_TOKENS], ids=["small", "big"])
def test_put_flush_get_round_trip_is_bitwise(store, dtype, tokens):
    c = chunk(tokens, dtype=dtype, logits=True, seed=tokens)
    assert store.get(key(1)) is None
    assert not store.contains(key(1))
    store.put(key(1), c)
    store.flush()
    assert store.contains(key(1))
    hit = store.get(key(1))
    assert hit is not None and hit.tier == "disk"
    assert_same_chunk(hit.chunk, c)
    assert hit.chunk.kv.device.type == "cpu"


def test_every_entry_is_a_file_of_its_own(store, store_dir):
    # never inside the SQLite file: a damaged database loses no KV (repair rebuilds it from the files)
    store.put(key(1), chunk(4))
    store.put(key(2), chunk(BIG_TOKENS))
    store.flush()
    files = val_files(store_dir)
    assert len(files) == 2
    assert all(f.read_bytes()[:4] == b"KVB2" for f in files)


def test_stats_count_hits_misses_puts_and_bytes(store):
    a, b = chunk(4, seed=1), chunk(8, seed=2, logits=True)
    store.put(key(1), a)
    store.put(key(2), b, pin=True)
    store.flush()
    store.get(key(1))
    store.get(key(1))
    store.get(key(3))
    s = disk_stats(store)
    assert (s.hits, s.misses, s.puts) == (2, 1, 2)
    assert s.entries == 2 and s.pinned == 1
    assert s.bytes == entry_bytes(key(1), a) + entry_bytes(key(2), b)
    assert list(store.stats()) == ["disk"]


def test_replacing_a_key_serves_the_new_value(store):
    store.put(key(1), chunk(4, fill=1.0))
    store.put(key(1), chunk(8, fill=2.0))
    store.flush()
    hit = store.get(key(1))
    assert hit.chunk.num_tokens == 8 and hit.chunk.kv.flatten()[0].item() == 2.0
    s = disk_stats(store)
    assert s.entries == 1 and s.bytes == entry_bytes(key(1), chunk(8, fill=2.0))


def test_remove(store):
    store.put(key(1), chunk())
    assert store.remove(key(1)) is True
    assert store.remove(key(1)) is False
    assert store.get(key(1)) is None
    assert disk_stats(store).entries == 0


def test_background_writes_false_is_synchronous(store_dir):
    store = DiskStore(store_dir, namespace=NS, background_writes=False)
    try:
        c = chunk(BIG_TOKENS, logits=True)
        store.put(key(1), c)
        # no flush: the write already happened
        assert store.contains(key(1))
        assert_same_chunk(store.get(key(1)).chunk, c)
        other = DiskStore(store_dir, namespace=NS, background_writes=False)
        try:
            assert_same_chunk(other.get(key(1)).chunk, c)
        finally:
            other.close()
        s = disk_stats(store)
        assert (s.puts, s.entries, s.hits) == (1, 1, 1)
    finally:
        store.close()


# -- persistence ---------------------------------------------------------------


def test_entries_survive_close_and_reopen(store_dir):
    small, big = chunk(4, logits=True, seed=3), chunk(BIG_TOKENS, dtype=torch.bfloat16, seed=4)
    first = DiskStore(store_dir, namespace=NS)
    first.put(key(1), small)
    first.put(key(2), big, pin=True)
    first.close()  # close flushes pending writes

    second = DiskStore(store_dir, namespace=NS)
    try:
        assert second.contains(key(1)) and second.contains(key(2))
        assert_same_chunk(second.get(key(1)).chunk, small)
        assert_same_chunk(second.get(key(2)).chunk, big)
        s = disk_stats(second)
        assert s.entries == 2 and s.pinned == 1
        assert sorted(second.keys()) == [key(1), key(2)]
    finally:
        second.close()


def test_two_open_stores_see_each_others_writes(store_dir):
    a = DiskStore(store_dir, namespace=NS)
    b = DiskStore(store_dir, namespace=NS)
    try:
        c = chunk(BIG_TOKENS, seed=5)
        assert b.get(key(1)) is None
        a.put(key(1), c)
        a.flush()
        assert_same_chunk(b.get(key(1)).chunk, c)
    finally:
        a.close()
        b.close()


def test_close_is_idempotent(store_dir):
    s = DiskStore(store_dir, namespace=NS)
    s.put(key(1), chunk())
    s.close()
    s.close()


# -- corruption is a miss ------------------------------------------------------


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _truncate_to_nothing(path: Path) -> None:
    path.write_bytes(b"")


def _flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[12] ^= 0x01
    path.write_bytes(bytes(data))


def _delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    "damage",
    [_flip, _flip_header, _truncate, _truncate_to_nothing, _delete],
    ids=lambda f: f.__name__.strip("_"),
)
def test_damaged_payload_file_is_a_counted_logged_removed_miss(store, store_dir, caplog, damage):
    good = chunk(BIG_TOKENS, seed=6)
    store.put(key(1), chunk(BIG_TOKENS, seed=7))
    store.put(key(2), good)
    store.flush()
    files = val_files(store_dir)
    assert len(files) == 2
    target = next(p for p in files if p.read_bytes() == encode(chunk(BIG_TOKENS, seed=7), NS, key(1)))
    damage(target)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(key(1)) is None
    s = disk_stats(store)
    assert s.extra.get("corrupt") == 1
    assert s.misses == 1 and s.hits == 0
    assert not store.contains(key(1))
    assert key(1) not in list(store.keys())
    assert s.entries == 1
    assert any(r.levelno == logging.WARNING and key(1)[:12] in r.getMessage() for r in caplog.records)
    assert not target.exists()  # the damaged file is gone too
    # a second read is a plain miss, not counted again
    assert store.get(key(1)) is None
    assert disk_stats(store).extra.get("corrupt") == 1
    # the other entry is untouched, and the key can be stored again
    assert_same_chunk(store.get(key(2)).chunk, good)
    fresh = chunk(BIG_TOKENS, seed=8)
    store.put(key(1), fresh)
    store.flush()
    assert_same_chunk(store.get(key(1)).chunk, fresh)


def test_damaged_inline_entry_is_a_miss(store, store_dir, caplog):
    store._cache.disk.min_file_size = 2**15  # as earlier versions stored small entries: inside SQLite
    store.put(key(1), chunk(4))
    store.flush()
    assert val_files(store_dir) == [] and store.get(key(1)) is not None
    con = sqlite3.connect(store_dir / "kv" / "cache.db")
    (value,) = con.execute("SELECT value FROM Cache").fetchone()
    bad = bytearray(value)
    bad[-1] ^= 0x01
    con.execute("UPDATE Cache SET value = ?", (sqlite3.Binary(bytes(bad)),))
    con.commit()
    con.close()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(key(1)) is None
    assert disk_stats(store).extra["corrupt"] == 1
    assert not store.contains(key(1))
    assert caplog.records


def test_foreign_namespace_entry_is_a_miss_then_can_be_stored(store_dir, caplog):
    a = DiskStore(store_dir, namespace="A")
    b = DiskStore(store_dir, namespace="B")
    try:
        theirs, ours = chunk(BIG_TOKENS, seed=9), chunk(BIG_TOKENS, seed=10)
        a.put(key(1), theirs)
        a.flush()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert b.get(key(1)) is None
        assert disk_stats(b).extra["corrupt"] == 1
        assert caplog.records
        b.put(key(1), ours)
        b.flush()
        assert_same_chunk(b.get(key(1)).chunk, ours)
        assert list(b.keys()) == [key(1)]
        assert disk_stats(b).entries == 1
        assert b.namespaces() == {"B": (1, entry_bytes(key(1), ours, "B"))}
        # and A, in turn, refuses B's entry
        assert a.get(key(1)) is None
    finally:
        a.close()
        b.close()


def test_overwriting_a_foreign_entry_moves_it_to_the_new_namespace(store_dir):
    a = DiskStore(store_dir, namespace="A")
    b = DiskStore(store_dir, namespace="B")
    try:
        a.put(key(1), chunk(4))
        a.flush()
        ours = chunk(8, seed=11)
        b.put(key(1), ours)  # without reading A's entry first
        b.flush()
        assert_same_chunk(b.get(key(1)).chunk, ours)
        assert list(b.keys()) == [key(1)]
        assert disk_stats(b).entries == 1
        assert b.drop_namespaces({"B"}) == 0
        assert b.contains(key(1))
    finally:
        a.close()
        b.close()


# -- never pickle ------------------------------------------------------------------


@pytest.mark.parametrize("value", [{"a": 1}, [1, 2], torch.zeros(3), "text", 7, None], ids=repr)
def test_kvdisk_refuses_to_store_non_bytes(store, value):
    assert isinstance(store._cache.disk, KVDisk)
    with pytest.raises(TypeError):
        store._cache.set(key(1), value)
    assert key(1) not in store._cache


def test_kvdisk_refuses_non_string_keys(store):
    with pytest.raises(TypeError):
        store._cache.set(b"raw-key", b"KVB1")


def test_a_pickled_row_is_refused_as_corrupt(store, store_dir, caplog):
    plain = diskcache.Cache(str(store_dir / "kv"), eviction_policy="none", size_limit=2**62, cull_limit=0)
    plain.set(key(1), {"kv": [1.0, 2.0]})  # pickled by the default Disk
    plain.set(key(2), list(range(20_000)))  # a pickle big enough to be a file
    plain.close()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(key(1)) is None
        assert store.get(key(2)) is None
    assert disk_stats(store).extra["corrupt"] == 2
    assert not store.contains(key(1)) and not store.contains(key(2))
    assert len(caplog.records) >= 2


def test_kvdisk_fetch_refuses_pickle_mode_directly(store):
    with pytest.raises(CorruptEntryError):
        store._cache.disk.fetch(diskcache.core.MODE_PICKLE, None, b"\x80\x04K\x01.", False)


@pytest.mark.parametrize("value", ["short text", "x" * 40_000, 1.5], ids=["text", "text-file", "float"])
def test_a_foreign_non_bytes_row_is_a_miss(store, store_dir, value):
    plain = diskcache.Cache(str(store_dir / "kv"), eviction_policy="none", size_limit=2**62, cull_limit=0)
    plain.set(key(1), value)
    plain.close()
    assert store.get(key(1)) is None
    assert disk_stats(store).extra["corrupt"] == 1


# -- eviction --------------------------------------------------------------------


@pytest.fixture
def budget_store(store_dir):
    """A store that holds two and a half 4-token entries."""
    size = entry_bytes(key(0), chunk(4))
    s = DiskStore(store_dir, namespace=NS, max_bytes=int(2.5 * size))
    yield s
    s.close()


def test_total_bytes_stay_within_max_bytes(budget_store):
    size = entry_bytes(key(0), chunk(4))
    for i in range(12):
        budget_store.put(key(i), chunk(4, seed=i), cost=float(1 + i % 3))
        budget_store.flush()
        s = disk_stats(budget_store)
        assert s.bytes <= budget_store.max_bytes
        assert s.entries == min(i + 1, 2)
        assert sum(b for _, b in budget_store.namespaces().values()) <= budget_store.max_bytes
    s = disk_stats(budget_store)
    assert s.evictions == 10 and s.bytes == 2 * size
    # what the index keeps is what the cache keeps
    present = [k for k in (key(i) for i in range(12)) if budget_store.contains(k)]
    assert sorted(present) == sorted(budget_store.keys())


def test_pinned_entries_are_never_evicted(budget_store):
    budget_store.put(key(100), chunk(4, seed=100), pin=True)
    for i in range(10):
        budget_store.put(key(i), chunk(4, seed=i), cost=1000.0)
        budget_store.flush()
        assert budget_store.contains(key(100))
        assert disk_stats(budget_store).bytes <= budget_store.max_bytes
    assert_same_chunk(budget_store.get(key(100)).chunk, chunk(4, seed=100))
    assert disk_stats(budget_store).pinned == 1


def test_pin_method_protects_an_existing_entry(budget_store):
    budget_store.put(key(100), chunk(4, seed=100))
    assert budget_store.pin(key(100)) is True
    for i in range(6):
        budget_store.put(key(i), chunk(4, seed=i), cost=1000.0)
    budget_store.flush()
    assert budget_store.contains(key(100))
    assert budget_store.pin(key(100), False) is True
    for i in range(6, 12):
        budget_store.put(key(i), chunk(4, seed=i), cost=1000.0)
    budget_store.flush()
    assert not budget_store.contains(key(100))


def test_pin_of_an_unknown_key_is_false(store):
    assert store.pin(key(404)) is False
    assert store.pin(key(404), False) is False
    assert disk_stats(store).pinned == 0


def test_often_read_entry_survives_a_never_read_one(budget_store):
    budget_store.put(key(1), chunk(4, seed=1))  # hot, and the oldest
    budget_store.put(key(2), chunk(4, seed=2))  # cold
    budget_store.flush()
    for _ in range(5):
        assert budget_store.get(key(1)) is not None
    budget_store.put(key(3), chunk(4, seed=3))
    budget_store.flush()
    assert budget_store.contains(key(1))
    assert not budget_store.contains(key(2))
    assert budget_store.contains(key(3))
    assert disk_stats(budget_store).evictions == 1


def test_high_cost_entry_survives_a_low_cost_one(budget_store):
    budget_store.put(key(1), chunk(4, seed=1), cost=100.0)  # dear, and the oldest
    budget_store.put(key(2), chunk(4, seed=2), cost=1.0)  # cheap
    budget_store.put(key(3), chunk(4, seed=3), cost=10.0)
    budget_store.flush()
    assert budget_store.contains(key(1))
    assert not budget_store.contains(key(2))
    assert budget_store.contains(key(3))


def test_evict_to_frees_down_to_the_target(store):
    size = entry_bytes(key(0), chunk(4))
    for i in range(6):
        store.put(key(i), chunk(4, seed=i))
    store.flush()
    assert store.evict_to(6 * size) == 0
    assert store.evict_to(3 * size) == 3
    assert disk_stats(store).bytes == 3 * size
    assert disk_stats(store).evictions == 3


# -- maintenance -----------------------------------------------------------------


@pytest.fixture
def three_namespaces(store_dir):
    stores = {ns: DiskStore(store_dir, namespace=ns) for ns in ("A", "B", "C")}
    for n, (ns, s) in enumerate(stores.items()):
        for i in range(n + 1):
            s.put(f"{ns}-{i}", chunk(4, seed=i))
        s.flush()
    yield stores
    for s in stores.values():
        s.close()


def test_namespaces(three_namespaces):
    a = three_namespaces["A"]
    size = entry_bytes("A-0", chunk(4), "A")
    assert a.namespaces() == {"A": (1, size), "B": (2, 2 * size), "C": (3, 3 * size)}


def test_keys_of_own_other_and_all_namespaces(three_namespaces):
    b = three_namespaces["B"]
    assert sorted(b.keys()) == ["B-0", "B-1"]
    assert sorted(b.keys("C")) == ["C-0", "C-1", "C-2"]
    assert sorted(b.keys("*")) == ["A-0", "B-0", "B-1", "C-0", "C-1", "C-2"]
    assert list(b.keys("nope")) == []


def test_drop_namespaces_keeps_only_the_given_ones(three_namespaces):
    a, b, c = (three_namespaces[ns] for ns in "ABC")
    assert a.drop_namespaces({"A", "C"}) == 2
    assert set(a.namespaces()) == {"A", "C"}
    assert not b.contains("B-0") and not b.contains("B-1")
    assert b.get("B-0") is None
    assert all(c.contains(f"C-{i}") for i in range(3))
    assert a.get("A-0") is not None
    assert disk_stats(b).entries == 0
    assert a.drop_namespaces({"A", "C"}) == 0
    assert a.drop_namespaces(set()) == 4
    assert a.namespaces() == {}
    assert list(a.keys("*")) == []


def test_clear(store, store_dir):
    for i in range(3):
        store.put(key(i), chunk(BIG_TOKENS if i == 0 else 4, seed=i), pin=i == 1)
    store.flush()
    store.clear()
    assert all(not store.contains(key(i)) for i in range(3))
    assert store.get(key(0)) is None
    s = disk_stats(store)
    assert s.entries == 0 and s.bytes == 0 and s.pinned == 0
    assert store.namespaces() == {}
    assert val_files(store_dir) == []
    store.put(key(5), chunk())
    store.flush()
    assert store.contains(key(5))


def test_read_checked(three_namespaces):
    a = three_namespaces["A"]
    assert_same_chunk(a.read_checked("B-1", "B"), chunk(4, seed=1))
    with pytest.raises(CorruptEntryError):
        a.read_checked("B-1", "A")
    with pytest.raises(CorruptEntryError):
        a.read_checked("missing", "A")


# -- unusable directories -------------------------------------------------------


def test_store_dir_under_a_regular_file_raises_store_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError) as info:
        DiskStore(blocker / "store", namespace=NS)
    msg = str(info.value)
    assert "store_dir" in msg and "writable" in msg
    assert str(blocker / "store") in msg
    assert isinstance(info.value, OSError)


def test_store_dir_that_is_a_regular_file_raises_store_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="store_dir"):
        DiskStore(blocker, namespace=NS)
    assert blocker.read_text() == "x"  # nothing stored is lost


@pytest.mark.parametrize("root", ["/proc", "/sys"])
def test_read_only_filesystem_raises_store_error(root):
    path = Path(root) / "kvboost-rag-test-store"
    try:
        os.mkdir(path)
    except OSError:
        pass
    else:
        os.rmdir(path)
        pytest.skip(f"{root} is writable here")
    with pytest.raises(StoreError, match="writable"):
        DiskStore(path, namespace=NS)
    assert not path.exists()


def test_unwritable_directory_raises_store_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(StoreError, match="writable"):
            DiskStore(ro, namespace=NS)
    finally:
        ro.chmod(0o755)


# -- full disk ------------------------------------------------------------------------


@pytest.mark.parametrize("background", [True, False], ids=["background", "sync"])
def test_full_disk_turns_the_tier_off(store_dir, monkeypatch, caplog, background):
    store = DiskStore(store_dir, namespace=NS, background_writes=background)
    try:
        early = chunk(BIG_TOKENS, seed=20)
        store.put(key(1), early)
        store.flush()
        assert store.disabled_reason is None

        calls = []
        real_set = store._cache.set

        def full(*args, **kwargs):
            calls.append(args[0])
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store._cache, "set", full)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            store.put(key(2), chunk(4, seed=21))  # must not raise
            store.flush()
        assert store.disabled_reason is not None
        assert "space" in store.disabled_reason.lower()
        assert any(r.levelno == logging.WARNING and "full" in r.getMessage() for r in caplog.records)
        assert calls == [key(2)]

        # even with room again, later puts are ignored
        monkeypatch.setattr(store._cache, "set", real_set)
        store.put(key(3), chunk(4, seed=22))
        store.flush()
        assert calls == [key(2)]
        assert not store.contains(key(2)) and not store.contains(key(3))
        assert disk_stats(store).puts == 1
        # reads still work
        assert_same_chunk(store.get(key(1)).chunk, early)
        assert store.get(key(3)) is None
    finally:
        store.close()


def test_other_write_errors_are_not_mistaken_for_a_full_disk(store, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(store._cache, "set", broken)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        store.put(key(1), chunk())
        store.flush()  # the background writer survives and reports it
    assert store.disabled_reason is None
    assert caplog.records
    monkeypatch.undo()
    store.put(key(2), chunk())
    store.flush()
    assert store.contains(key(2))


# -- races with other processes (simulated in one process, deterministically) -------


def test_a_replace_racing_a_read_does_not_delete_the_new_entry(store_dir):
    import types

    reader = DiskStore(store_dir, namespace=NS, background_writes=False)
    writer = DiskStore(store_dir, namespace=NS, background_writes=False)
    try:
        old, new = chunk(BIG_TOKENS, seed=30), chunk(BIG_TOKENS, seed=31)
        writer.put(key(1), old)
        disk = reader._cache.disk
        real_fetch = type(disk).fetch
        raced = []

        def fetch_racing_a_replace(self, mode, filename, value, read):
            # the reader has looked the row up; now another process stores the same key again
            # (a second prewarm, or two servers computing the same chunk): new file, old file deleted
            if not raced:
                raced.append(filename)
                writer.put(key(1), new)
            return real_fetch(self, mode, filename, value, read)

        disk.fetch = types.MethodType(fetch_racing_a_replace, disk)
        hit = reader.get(key(1))
        assert raced and raced[0] is not None
        if hit is not None:  # served after the replace: then it is the new entry, whole
            assert_same_chunk(hit.chunk, new)
        assert writer.contains(key(1)), "the freshly stored entry was deleted by the racing reader"
        assert_same_chunk(writer.get(key(1)).chunk, new)
    finally:
        reader.close()
        writer.close()


# -- signed entries, file modes, unreadable payloads -------------------------------------------

SECRET = b"the store secret, 32 bytes long."


OTHER_SECRET = b"another secret, 32 bytes long.."


def test_under_mixed_secrets_each_reader_misses_the_others_entries_and_removes_none(store_dir, caplog):
    with DiskStore(store_dir, namespace=NS, secret=SECRET, background_writes=False) as signed:
        signed.put(key(1), chunk(BIG_TOKENS, fill=1.0))
        assert torch.equal(signed.get(key(1)).chunk.kv, chunk(BIG_TOKENS, fill=1.0).kv)
    with DiskStore(store_dir, namespace=NS, background_writes=False) as plain:
        assert plain.get(key(1)) is None  # signed with a secret this reader lacks: foreign
        plain.put(key(1), chunk(BIG_TOKENS, fill=9.0))  # its own copy does not replace the signed one
        plain.put(key(2), chunk(BIG_TOKENS, fill=2.0))  # unsigned: a writer without the secret
        assert plain.get(key(2)) is not None
        assert disk_stats(plain).extra["foreign"] == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING), DiskStore(store_dir, namespace=NS, secret=OTHER_SECRET) as other:
        for _ in range(3):
            assert other.get(key(1)) is None and other.get(key(2)) is None
        stats = disk_stats(other)
        assert stats.extra["foreign"] == 6 and stats.extra["corrupt"] == 0
    warnings = [r.getMessage() for r in caplog.records if "KVBOOST_STORE_SECRET" in r.getMessage()]
    assert len(warnings) == 2  # once per reason (signed otherwise, unsigned), with the fix
    with DiskStore(store_dir, namespace=NS, secret=SECRET) as signed:
        assert torch.equal(signed.get(key(1)).chunk.kv, chunk(BIG_TOKENS, fill=1.0).kv)  # still its own
        assert signed.get(key(2)) is None and signed.contains(key(2))  # unsigned: a miss, kept
        assert disk_stats(signed).extra["corrupt"] == 0


def test_a_damaged_entry_signed_with_the_readers_own_secret_is_removed(store_dir):
    with DiskStore(store_dir, namespace=NS, secret=SECRET, background_writes=False) as signed:
        signed.put(key(1), chunk(BIG_TOKENS, fill=1.0))
        (path,) = val_files(store_dir)
        _flip(path)
        assert signed.get(key(1)) is None and not signed.contains(key(1))
        assert disk_stats(signed).extra["corrupt"] == 1


def test_during_a_rotation_entries_of_both_secrets_are_read_and_new_ones_signed_with_the_first(store_dir):
    with DiskStore(store_dir, namespace=NS, secret=SECRET, background_writes=False) as old:
        old.put(key(1), chunk(BIG_TOKENS, fill=1.0))
    rotating = DiskStore(store_dir, namespace=NS, secret=[OTHER_SECRET, SECRET], background_writes=False)
    with rotating:
        assert rotating.get(key(1)) is not None
        rotating.put(key(2), chunk(BIG_TOKENS, fill=2.0))
    with DiskStore(store_dir, namespace=NS, secret=OTHER_SECRET) as new:
        assert new.get(key(2)) is not None  # written under the new secret
        assert new.get(key(1)) is None and disk_stats(new).extra["foreign"] == 1  # the old one's


def test_a_short_secret_is_refused(store_dir):
    with pytest.raises(ValueError, match="at least 16"):
        DiskStore(store_dir, namespace=NS, secret=b"too short")


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.parametrize(("file_mode", "dir_mode"), [(0o600, 0o700), (0o640, 0o750)])
def test_store_files_and_directories_are_created_private(store_dir, file_mode, dir_mode):
    with DiskStore(store_dir, namespace=NS, file_mode=file_mode, background_writes=False) as store:
        store.put(key(1), chunk(BIG_TOKENS))
        assert mode(store_dir) == dir_mode and mode(store_dir / "kv") == dir_mode
        payload = val_files(store_dir)[0]
        assert mode(payload) == file_mode and mode(payload.parent) == dir_mode
        for name in ("kv/cache.db", "index.sqlite", "index.sqlite-wal"):  # SQLite's -wal follows its file
            assert mode(store_dir / name) == file_mode, name


def test_an_unreadable_payload_is_a_counted_and_logged_miss(store, monkeypatch, caplog):
    store.put(key(1), chunk(BIG_TOKENS))
    store.flush()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("kvboost_rag.store.disk_files.open", refused, raising=False)  # as a 0000 file would
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(key(1)) is None
    assert disk_stats(store).extra["unreadable"] == 1
    assert "permissions" in caplog.text
    monkeypatch.undo()
    assert store.get(key(1)) is not None  # kept: a permission problem is not corruption


# -- maintenance helpers: keys the index lost, orphans, adoption ----------------------------


def test_an_entry_the_index_lost_is_found_and_indexed_again(store_dir):
    with DiskStore(store_dir, namespace=NS, background_writes=False) as store:
        store.put(key(1), chunk(BIG_TOKENS))
        store.put(key(2), chunk(4))
    con = sqlite3.connect(store_dir / "index.sqlite")
    con.execute("DELETE FROM entries")
    con.commit()
    con.close()
    with DiskStore(store_dir, namespace="", background_writes=False) as store:
        assert sorted(store.stored_keys()) == [key(1), key(2)] and store.indexed_namespaces() == {}
        assert store.reindex(key(1)) == NS and store.reindex(key(2)) == NS
        assert store.usage()[NS]["entries"] == 2


def test_orphans_are_removed_and_a_payload_file_can_be_adopted(store_dir):
    with DiskStore(store_dir, namespace=NS, background_writes=False) as store:
        store.put(key(1), chunk(BIG_TOKENS))
        store.put(key(2), chunk(BIG_TOKENS, seed=2))
        [first, second] = [p for p in val_files(store_dir)]
        saved = {p: p.read_bytes() for p in (first, second)}
        store._cache.delete(key(1))  # the payload database loses key 1 (its file goes too)
        assert key(1) not in store.stored_keys()
        for p, data in saved.items():  # a file that no entry names
            if not p.exists():
                stray = p
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
        assert store.unnamed_files() == [stray]
        assert store.remove_orphans(min_age_s=3600) == 1  # key 1's index row; the file is too new
        assert store.adopt(stray) == key(1) and not stray.exists()
        assert torch.equal(store.get(key(1)).chunk.kv, chunk(BIG_TOKENS).kv)
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_bytes(b"not an entry")
        assert store.remove_orphans(min_age_s=0) == 1 and not stray.exists()
