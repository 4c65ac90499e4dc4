"""Settings of the Redis tier, and the client it opens from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.retry import Retry


@dataclass(frozen=True)
class RedisOptions:
    """Everything a :class:`~kvboost_rag.store.redis.RedisStore` takes besides where and which namespace.

    ``EngineConfig.redis_options`` names these fields.

    >>> RedisOptions(ttl_s=60).ttl_s
    60
    >>> sorted(RedisOptions.names())[:3]
    ['background_writes', 'backoff_s', 'client_options']
    """

    key_prefix: str = "kvboost"
    """First part of every key; separates deployments that share a server."""
    password: str | None = field(default=None, repr=False)
    """Used when the URL carries none (never shown in a repr)."""
    ssl_ca_certs: str | None = None
    """TLS CA bundle (``rediss://`` URLs only, as are the two below)."""
    ssl_certfile: str | None = None
    """Client certificate, for servers that authenticate clients by TLS."""
    ssl_keyfile: str | None = None
    """The client certificate's private key."""
    client_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """Further ``redis.Redis`` arguments (``username``, ``ssl_cert_reqs``, ...); they win over ours."""
    ttl_s: float | None = None
    """Expiry of each entry, renewed when it is read; ``None``: no expiry."""
    max_bytes: int | None = None
    """Payload budget of the namespace; ``None``: the server's own limits."""
    connect_timeout_s: float = 0.5
    """Socket connect timeout of every call."""
    timeout_s: float = 2.0
    """Socket read/write timeout of every call."""
    backoff_s: float = 1.0
    """How long Redis is skipped after a failure (doubling while failures repeat) ..."""
    max_backoff_s: float = 30.0
    """... up to this."""
    max_pending_writes: int = 256
    """Bound of the write-back queue, in writes; a write beyond it is dropped."""
    max_pending_bytes: int = 512 * 1024**2
    """Bound of the write-back queue, in bytes."""
    warn_every_s: float = 30.0
    """At most one warning per kind of problem in this period."""
    registry_refresh_s: float = 1.0
    """How often the shared document list is polled."""
    background_writes: bool = True
    """``False`` writes synchronously (tests, tools)."""
    cluster: bool = False
    """The URL names a node of a Redis Cluster (or a Valkey cluster): entries spread over
    ``cluster_shards`` hash-tagged shards, and the client follows the cluster's slot map."""
    cluster_shards: int = 16
    """Shards of a namespace on a cluster. Each keeps its own records and evicts within
    ``max_bytes / cluster_shards``, so keep that share above the largest entry (a chunk)."""

    def __post_init__(self) -> None:
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s={self.ttl_s}: pass a positive number of seconds, or None for no expiry")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"max_bytes={self.max_bytes}: pass a byte budget >= 0, or None for no budget")
        if self.cluster_shards < 1:
            raise ValueError(f"cluster_shards={self.cluster_shards}: pass a number of shards >= 1")

    @classmethod
    def names(cls) -> frozenset[str]:
        """The option names (what ``EngineConfig.redis_options`` may hold)."""
        return frozenset(f.name for f in fields(cls))

    @property
    def ttl_ms(self) -> int:
        """The expiry in milliseconds as the scripts take it (0: none)."""
        return 0 if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

    def _tls_files(self) -> dict[str, str]:
        files = {
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile": self.ssl_keyfile,
        }
        return {name: path for name, path in files.items() if path}

    def check_url(self, url: str) -> None:
        """Raise ValueError, naming the fix, for a URL these settings cannot connect to."""
        tls = self._tls_files()
        if tls and not url.startswith("rediss://"):
            msg = f"TLS settings ({', '.join(tls)}) need a rediss:// URL; got {url.split('://', 1)[0]}://"
            raise ValueError(msg)
        try:
            parse_url(url)
        except ValueError as e:
            msg = f"bad Redis URL ({e}); use redis://[[user]:password@]host:port/db or rediss://... for TLS"
            raise ValueError(msg) from e
        if (self.client_options or {}).get("decode_responses"):
            msg = "client_options sets decode_responses; KV payloads need decode_responses=False"
            raise ValueError(msg)

    def connect(self, url: str) -> redis.Redis | RedisCluster:
        """A client for ``url`` with these settings. A standalone client sends nothing yet; a cluster
        client reads the cluster's slot map from the node as it is made (so the store makes it when
        it is first needed)."""
        self.check_url(url)
        settings: dict[str, Any] = {
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_timeout": self.timeout_s,
            # No client-side retries: the back-off decides when Redis is tried again, and a
            # retry would multiply the time a request can spend on a dead server.
            "retry": Retry(NoBackoff(), 0),
        }
        if not self.cluster:
            settings["health_check_interval"] = 0
        if self.password is not None:
            settings["password"] = self.password
        settings.update(self._tls_files())
        settings.update(self.client_options or {})  # the caller's word wins, timeouts included
        if self.cluster:
            return RedisCluster.from_url(url, **settings)
        return redis.Redis.from_url(url, **settings)


def describe(client: redis.Redis | RedisCluster) -> str:
    """``host:port/db`` of a client's server, without credentials (for messages)."""
    return _where(client.get_connection_kwargs())


def describe_url(url: str) -> str:
    """``host:port/db`` (or ``socket-path/db``) of a URL, without credentials; raises ValueError for a
    URL redis-py refuses.

    >>> describe_url("redis://:s3cret@cache:6380/2"), describe_url("unix:///run/redis.sock?db=1")
    ('cache:6380/2', '/run/redis.sock/1')
    """
    return _where({"port": 6379, **parse_url(url)})


def _where(kw: Mapping[str, Any]) -> str:
    where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
    return f"{where}/{kw.get('db', 0)}"
