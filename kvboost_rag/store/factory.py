"""Opening the engine's store from its configuration: memory, then disk, then Redis."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import EngineConfig
from ..errors import StoreError
from .base import KVStore
from .disk import DiskStore
from .memory import MemoryStore
from .tiered import TieredStore


def open_store(config: EngineConfig, namespace: str, store_dir: str | Path | None) -> KVStore:
    """The store an engine with ``config`` uses for ``namespace``.

    The memory tier always; the disk tier in ``store_dir`` unless it is None; the Redis tier
    when ``config.redis_url`` is set. One tier is returned as is, more as a :class:`TieredStore`
    (fastest first). When a tier cannot be opened, those opened before it are closed again.

    >>> store = open_store(EngineConfig(), "ns", None)
    >>> [tier.name for tier in store.tiers]
    ['memory']
    """
    tiers: list[KVStore] = [MemoryStore(config.max_memory_bytes)]
    try:
        if store_dir is not None:
            disk = DiskStore(
                store_dir,
                namespace,
                max_bytes=config.max_disk_bytes,
                secret=config.store_secrets_bytes,
                file_mode=config.store_file_mode,
                codec=config.store_codec,
            )
            tiers.append(disk)
        if config.redis_url is not None:
            tiers.append(open_redis(config, namespace))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def open_redis(config: EngineConfig, namespace: str) -> KVStore:
    """The shared Redis tier of ``config.redis_url``; opening it sends nothing, so a server that is
    down only costs misses. Raises :class:`StoreError` without the ``redis`` package, ValueError for
    an unknown name in ``config.redis_options``."""
    try:
        from .redis import RedisStore
        from .redis_options import RedisOptions
    except ImportError as e:
        msg = "redis_url needs the redis package: pip install 'kvboost-rag[redis]'"
        raise StoreError(msg) from e
    if config.redis_url is None:
        raise ValueError("open_redis needs config.redis_url")
    known = RedisOptions.names()
    unknown = sorted(set(config.redis_options) - known)
    if unknown:
        msg = f"redis_options: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        raise ValueError(msg)
    options = RedisOptions(
        key_prefix=config.redis_key_prefix, ttl_s=config.redis_ttl_s, max_bytes=config.max_redis_bytes
    )
    return RedisStore(
        config.redis_url,
        namespace=namespace,
        options=replace(options, **config.redis_options),
        secret=config.store_secrets_bytes,
        codec=config.store_codec,
    )
