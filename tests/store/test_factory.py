"""open_store: the engine's tiers from its configuration, Redis settings checked by name."""

from __future__ import annotations

import sys

import pytest

from kvboost_rag.config import EngineConfig
from kvboost_rag.errors import StoreError
from kvboost_rag.store import DiskStore, MemoryStore, TieredStore, open_store
from kvboost_rag.store.disk import DiskStore as DiskTier

NS = "model-a|tok|float32|v1"
DOWN = "redis://127.0.0.1:1/0"  # nothing is sent until the first call, so nothing needs to listen


def test_memory_only_is_the_memory_tier_itself():
    store = open_store(EngineConfig(max_memory_bytes=1234), NS, None)
    assert isinstance(store, MemoryStore) and store.max_bytes == 1234
    assert store.tiers == [store] and store.shared_records() is None


def test_a_store_dir_adds_the_disk_tier(tmp_path):
    store = open_store(EngineConfig(max_disk_bytes=1 << 20), NS, tmp_path / "store")
    try:
        assert isinstance(store, TieredStore)
        memory, disk = store.tiers
        assert isinstance(memory, MemoryStore) and isinstance(disk, DiskStore)
        assert (disk.namespace, disk.max_bytes, disk.directory) == (NS, 1 << 20, tmp_path / "store")
    finally:
        store.close()


def test_redis_settings_come_from_the_config_and_redis_options_win():
    pytest.importorskip("redis")
    config = EngineConfig(
        redis_url=DOWN,
        redis_key_prefix="deploy",
        redis_ttl_s=60,
        max_redis_bytes=1 << 20,
        redis_options={"timeout_s": 0.25, "key_prefix": "override", "background_writes": False},
    )
    store = open_store(config, NS, None)
    try:
        memory, red = store.tiers
        assert [memory.name, red.name] == ["memory", "redis"]
        assert (red.namespace, red.key_prefix, red.ttl_s, red.max_bytes) == (NS, "override", 60, 1 << 20)
        assert red.options.timeout_s == 0.25 and not red.options.background_writes
        assert store.shared_records() is not None  # the Redis tier shares registry records
    finally:
        store.close()


def test_unknown_redis_options_are_named_with_the_known_ones():
    pytest.importorskip("redis")
    from kvboost_rag.store.redis_options import RedisOptions

    with pytest.raises(ValueError, match=r"unknown option\(s\) nope, timeout; known: background_writes") as e:
        open_store(EngineConfig(redis_url=DOWN, redis_options={"timeout": 1, "nope": 2}), NS, None)
    assert all(name in str(e.value) for name in RedisOptions.names())


def test_without_the_redis_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvboost_rag.store.redis", None)  # import fails as without redis-py
    with pytest.raises(StoreError, match=r"pip install 'kvboost-rag\[redis\]'"):
        open_store(EngineConfig(redis_url=DOWN), NS, None)


def test_tiers_opened_before_a_failing_one_are_closed(tmp_path, monkeypatch):
    pytest.importorskip("redis")
    closed: list[str] = []
    real_close = DiskTier.close
    monkeypatch.setattr(DiskTier, "close", lambda self: (closed.append(self.name), real_close(self)))
    with pytest.raises(ValueError, match="ttl_s"):
        open_store(EngineConfig(redis_url=DOWN, redis_options={"ttl_s": -1}), NS, tmp_path / "store")
    assert closed == ["disk"]
