"""Store maintenance: scans find what the index lost and what no entry names, recompute checks
remove entries that differ, and repair rebuilds damaged databases from the payloads."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.errors import DamagedStoreError
from kvboost_rag.maintenance import damaged_databases, drop_foreign, recompute_sample, repair, scan
from kvboost_rag.registry import DocumentRegistry
from kvboost_rag.store import DiskStore, ForeignEntryError
from kvboost_rag.store.serialization import encode

PROMPT = "A key-value cache stores attention keys and values per token. " * 12
SECRET = "the store secret, 32 bytes long."


def make_engine(store_dir: Path, **config) -> KVBoostEngine:
    return KVBoostEngine(
        tiny_model("llama"),
        tiny_tokenizer(),
        config=EngineConfig(chunk_size=16, **config),
        store_dir=store_dir,
    )


@pytest.fixture
def filled(tmp_path) -> Path:
    """A store that holds the chunks of PROMPT."""
    store_dir = tmp_path / "store"
    with make_engine(store_dir) as engine:
        engine.generate(PROMPT, max_new_tokens=1)
        engine.registry.register([PROMPT])
    return store_dir


def fresh_logits(prompt: str) -> torch.Tensor:
    engine = KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16))
    return engine.generate(prompt, max_new_tokens=1, return_logits=True).first_logits


def cached_logits(store_dir: Path, **config) -> tuple[int, torch.Tensor]:
    with make_engine(store_dir, **config) as engine:
        r = engine.generate(PROMPT, max_new_tokens=1, return_logits=True)
    return r.usage.cached_tokens, r.first_logits


def test_a_scan_indexes_again_what_the_index_lost_and_removes_orphans(filled):
    con = sqlite3.connect(filled / "index.sqlite")
    lost = con.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    con.execute("DELETE FROM entries WHERE rowid % 2 = 0")
    con.commit()
    con.close()
    stray = filled / "kv" / "ab" / "cd" / "stray.val"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"no entry names this file")
    with DiskStore(filled, namespace="", background_writes=False) as store:
        report = scan(store, orphan_age_s=0)
        assert report.checked == lost and 0 < report.reindexed < lost and report.ok
        assert report.orphans == 1 and not stray.exists()
        assert sum(u["entries"] for u in store.usage().values()) == lost


def test_a_forged_entry_passes_the_checksum_but_not_the_recompute_and_is_removed(filled):
    with DiskStore(filled, namespace="", background_writes=False) as store:
        key, namespace = next(iter(store.indexed_namespaces().items()))
        real = store.read_checked(key, namespace)
        forged = type(real)(torch.zeros_like(real.kv), real.last_logits, real.token_ids, real.parent_key)
        store._cache.set(key, encode(forged, namespace, key))  # a valid checksum over garbage KV
        assert scan(store).ok  # nothing a checksum can see
    with make_engine(filled) as engine:
        disk = next(t for t in engine.store.tiers if isinstance(t, DiskStore))
        report = recompute_sample(engine, disk, sample=len(list(disk.keys(engine.namespace))))
        assert report.mismatched == [key] and not disk.contains(key)
    cached, logits = cached_logits(filled)
    assert torch.equal(logits, fresh_logits(PROMPT))


def test_a_signed_store_refuses_a_forged_entry_at_once(tmp_path):
    store_dir = tmp_path / "store"
    with make_engine(store_dir, store_secret=SECRET) as engine:
        engine.generate(PROMPT, max_new_tokens=1)
    with DiskStore(store_dir, namespace="", background_writes=False, secret=SECRET.encode()) as store:
        key, namespace = next(iter(store.indexed_namespaces().items()))
        real = store.read_checked(key, namespace)
        forged = type(real)(torch.zeros_like(real.kv), real.last_logits, real.token_ids, real.parent_key)
        store._cache.set(key, encode(forged, namespace, key))  # written without the secret
    cached, logits = cached_logits(store_dir, store_secret=SECRET)
    assert cached > 0 and torch.equal(logits, fresh_logits(PROMPT))  # recomputed, never served
    with DiskStore(store_dir, namespace="", background_writes=False, secret=SECRET.encode()) as store:
        with pytest.raises(ForeignEntryError, match="unsigned"):  # foreign: kept, never served
            store.read_checked(key, namespace)
        assert scan(store).foreign == [key]
        assert drop_foreign(store) == 1 and not store.contains(key)


def damage(path: Path) -> None:
    path.write_bytes(b"this is not an SQLite database" * 100)
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@pytest.mark.parametrize("name", ["kv/cache.db", "index.sqlite", "documents.sqlite"])
def test_a_damaged_database_is_a_clear_error_and_repair_rebuilds_it(filled, name):
    cached_before, _ = cached_logits(filled)
    damage(filled / name)
    assert damaged_databases(filled) == [name]
    with pytest.raises(DamagedStoreError, match="kvboost-rag repair"):
        make_engine(filled)
    report = repair(filled)
    assert report.set_aside == [name] and list(filled.glob(f"{name}.damaged-*"))
    assert report.scan.ok and not damaged_databases(filled)
    if name == "kv/cache.db":
        assert report.adopted > 0  # every payload found its key again from its own header
    cached, logits = cached_logits(filled)
    assert cached == cached_before and torch.equal(logits, fresh_logits(PROMPT))
    if name == "documents.sqlite":
        assert len(DocumentRegistry(filled / "documents.sqlite")) == 0  # documents need pre-warming again


def test_repair_leaves_a_healthy_store_as_it_is(filled):
    mtimes = {p: p.stat().st_mtime for p in filled.rglob("*.val")}
    time.sleep(0.01)
    report = repair(filled)
    assert report.set_aside == [] and report.adopted == 0 and report.scan.ok
    assert {p: p.stat().st_mtime for p in filled.rglob("*.val")} == mtimes


def test_registry_files_are_private(tmp_path):
    DocumentRegistry(tmp_path / "documents.sqlite", file_mode=0o600).close()
    assert os.stat(tmp_path / "documents.sqlite").st_mode & 0o777 == 0o600
