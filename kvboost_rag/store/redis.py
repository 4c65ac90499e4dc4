"""Remote tier: chunk KV in Redis, shared by every worker process that can reach the server.

- Payloads are the disk tier's checked raw-buffer format (:mod:`.serialization`), never
  pickled; every read is checked against the namespace and key it was read under.
- Keys are ``{key_prefix}:{namespace}:{key}``. Per namespace, a few bookkeeping keys
  (``{key_prefix}:{namespace}:#sizes``, ``#lru``, ``#bytes``, ``#pinned``) hold entry sizes,
  last access times, the byte total and the pins; small Lua scripts keep them consistent
  with the payloads, atomically, whichever process writes.
- Writes are write-back on a background thread behind a bounded queue: ``put`` returns at
  once, and when the queue is full the write is dropped (counted, logged) rather than
  making generation wait. :meth:`RedisStore.flush` waits for the queue.
- Redis is a cache here, so it may fail in any way without failing a request: down, slow
  or returning garbage, a read is a miss and a write is dropped, both counted in
  ``stats()["redis"].extra`` and logged at most every ``warn_every_s`` per kind of
  problem. Every call runs under short socket timeouts and without client-side retries,
  and after a failure the tier is skipped for a back-off period (doubling while failures
  repeat), so a dead server costs one timeout per period instead of one per chunk.
- ``ttl_s`` sets an expiry on every write and renews it on every read (a sliding expiry:
  documents that keep being used stay). Pinned entries never expire and are never
  evicted. ``max_bytes`` bounds a namespace's payload bytes: beyond it, unpinned entries
  are evicted least recently used first.
- The store also offers :class:`RedisRecords`, the document registry's shared part, so a
  flat prompt can be split at documents that another process pre-warmed.

Only a standalone server (or a primary with replicas) is supported, not Redis Cluster:
the scripts touch keys of one namespace that may live in different cluster slots.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..registry import ANCHOR_CHARS, Source
from .base import Hit, KVStore, StoredChunk, TierCounters, TierStats
from .serialization import CorruptEntryError, decode, encode
from .writer import BackgroundWriter, close_at_exit, closed

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_EXTRA_COUNTERS = ("errors", "corrupt", "skipped", "dropped_writes", "expired")
"""``stats()["redis"].extra``: failed calls, unusable values (counted misses), calls skipped while
backing off, writes dropped for a full queue, and records of expired entries forgotten."""

# KEYS: payload, sizes, lru, bytes, pinned
# ARGV: data, member, now, ttl_ms (0: none), pin (0/1), max_bytes (-1: none), payload key prefix
# Returns {evicted, expired}: entries removed for space, and stale records of expired entries.
_PUT = """
local member = ARGV[2]
if ARGV[5] == '1' then redis.call('SADD', KEYS[5], member) end
local pinned = redis.call('SISMEMBER', KEYS[5], member) == 1
local ttl = tonumber(ARGV[4])
if ttl > 0 and not pinned then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
local size = string.len(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[2], member) or '0')
redis.call('HSET', KEYS[2], member, size)
local total = redis.call('INCRBY', KEYS[4], size - old)
redis.call('ZADD', KEYS[3], ARGV[3], member)
local limit = tonumber(ARGV[6])
local evicted, expired, skip = 0, 0, 0
while limit >= 0 and total > limit do
  local batch = redis.call('ZRANGE', KEYS[3], skip, skip + 127)
  if #batch == 0 then break end
  for _, m in ipairs(batch) do
    if total <= limit then break end
    if redis.call('SISMEMBER', KEYS[5], m) == 1 then
      skip = skip + 1
    else
      local n = tonumber(redis.call('HGET', KEYS[2], m) or '0')
      if redis.call('DEL', ARGV[7] .. m) == 1 then evicted = evicted + 1 else expired = expired + 1 end
      redis.call('HDEL', KEYS[2], m)
      redis.call('ZREM', KEYS[3], m)
      total = redis.call('DECRBY', KEYS[4], n)
    end
  end
end
return {evicted, expired}
"""

# KEYS: payload, lru, pinned.  ARGV: member, now, ttl_ms (0: none)
_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 'XX', ARGV[2], ARGV[1])
if tonumber(ARGV[3]) > 0 and redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
"""

# KEYS: payload, pinned.  ARGV: member, pin (0/1), ttl_ms (0: none).  Returns whether the entry exists.
_PIN = """
local present = redis.call('EXISTS', KEYS[1]) == 1
if ARGV[2] == '1' then
  if not present then return 0 end
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('PERSIST', KEYS[1])
else
  redis.call('SREM', KEYS[2], ARGV[1])
  if present and tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
end
if present then return 1 else return 0 end
"""

# KEYS: payload, sizes, lru, bytes, pinned.  ARGV: member
_DROP = """
redis.call('DEL', KEYS[1])
local n = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if n > 0 then redis.call('DECRBY', KEYS[4], n) end
return n
"""

# Forget the records of entries that expired. KEYS: sizes, lru, bytes.
# ARGV: access-time cutoff, payload key prefix, most records to look at.  Returns how many went.
_REAP = """
local gone = 0
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))) do
  if redis.call('EXISTS', ARGV[2] .. m) == 0 then
    local n = tonumber(redis.call('HGET', KEYS[1], m) or '0')
    redis.call('HDEL', KEYS[1], m)
    redis.call('ZREM', KEYS[2], m)
    redis.call('DECRBY', KEYS[3], n)
    gone = gone + 1
  end
end
return gone
"""

# KEYS: document list, document digests.  ARGV: digest, text, digest, text, ...
_ADD_DOCUMENTS = """
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[1], ARGV[i + 1])
    added = added + 1
  end
end
return added
"""


class _Unavailable(Exception):
    """Redis was skipped (back-off) or failed; the caller falls back to a miss."""


class _WrongType(Exception):
    """A key of ours holds a value of another Redis type: garbage, handled like a corrupt entry."""


class _Breaker:
    """Skip Redis for a while after a failure; the pause doubles while failures repeat."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._failures = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def success(self) -> None:
        if self._failures:
            with self._lock:
                self._failures = 0

    def failure(self) -> float:
        """Record a failure; returns the pause that starts now."""
        with self._lock:
            self._failures += 1
            pause = min(self.backoff_s * 2 ** (self._failures - 1), self.max_backoff_s)
            self._open_until = time.monotonic() + pause
            return pause


class _Warnings:
    """One log line per kind of problem every ``every_s`` seconds, with a count of those held back."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -float("inf")) < self.every_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += " (%d similar warnings in the last %.0f s not shown)"
            args = (*args, held, self.every_s)
        logger.warning(msg, *args)


class RedisStore(KVStore):
    """Shared remote tier for one namespace on a Redis server.

    Give it a URL (``redis://[[user]:password@]host:port/db``, ``rediss://`` for TLS) or a
    ready ``redis.Redis`` client (whose own timeouts and retries then apply; it must
    return bytes, not decoded strings). Nothing is sent to Redis until the first call.

    >>> import torch
    >>> store = RedisStore("redis://127.0.0.1:6399/0", namespace="ns")  # doctest: +SKIP
    >>> store.put("k", StoredChunk(torch.ones(1, 2, 1, 3, 4))); store.flush()  # doctest: +SKIP
    >>> store.get("k").tier  # doctest: +SKIP
    'redis'
    >>> store.close()  # doctest: +SKIP

    When the server is unreachable every call is a quick miss:

    >>> down = RedisStore("redis://127.0.0.1:1/0", namespace="ns", connect_timeout_s=0.2)
    >>> down.get("k") is None, down.stats()["redis"].extra["errors"]
    (True, 1)
    >>> down.close()
    """

    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str,
        client: redis.Redis | None = None,
        key_prefix: str = "kvboost",
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        client_options: Mapping[str, Any] | None = None,
        ttl_s: float | None = None,
        max_bytes: int | None = None,
        connect_timeout_s: float = 0.5,
        timeout_s: float = 2.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_pending_writes: int = 256,
        max_pending_bytes: int = 512 * 1024**2,
        warn_every_s: float = 30.0,
        registry_refresh_s: float = 1.0,
        background_writes: bool = True,
    ) -> None:
        """
        Args:
            url: server address; ``password`` is used when the URL carries none.
            namespace: the engine's store namespace (model, tokenizer, dtype, layout).
            client: an existing client, instead of ``url`` and the connection settings.
            key_prefix: first part of every key; separates deployments that share a server.
            ssl_ca_certs, ssl_certfile, ssl_keyfile: TLS files (``rediss://`` URLs only).
            client_options: further ``redis.Redis`` arguments (``username``, ``ssl_cert_reqs``, ...).
            ttl_s: expiry of each entry, renewed when it is read; ``None``: no expiry.
            max_bytes: payload budget of this namespace; ``None``: the server's own limits.
            connect_timeout_s, timeout_s: socket connect and read/write timeouts of every call.
            backoff_s, max_backoff_s: how long Redis is skipped after a failure (doubling).
            max_pending_writes, max_pending_bytes: bounds of the write-back queue.
            warn_every_s: at most one warning per kind of problem in this period.
            registry_refresh_s: how often the shared document list is polled.
            background_writes: ``False`` writes synchronously (tests, tools).
        """
        if (url is None) == (client is None):
            raise ValueError("pass either a Redis url or a client")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s}: pass a positive number of seconds, or None for no expiry")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: pass a byte budget >= 0, or None for no budget")
        self.namespace = namespace
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.registry_refresh_s = registry_refresh_s
        if client is None:
            assert url is not None
            tls = {k: v for k, v in zip(_TLS_OPTIONS, (ssl_ca_certs, ssl_certfile, ssl_keyfile)) if v}
            client = _connect(url, password, tls, dict(client_options or {}), connect_timeout_s, timeout_s)
        if client.get_connection_kwargs().get("decode_responses"):
            msg = "the Redis client decodes responses to str; KV payloads need decode_responses=False"
            raise ValueError(msg)
        self._client = client
        self.server = _describe(self._client)
        """``host:port/db`` of the server, without credentials (for messages)."""
        self._base = f"{key_prefix}:{namespace}:"
        # Bookkeeping keys: '#' never starts a prefix key (hex), so they cannot collide with entries.
        self._meta = {
            name: f"{self._base}#{name}"
            for name in ("sizes", "lru", "bytes", "pinned", "docs", "doc-ids", "sources")
        }
        self._put_script = self._client.register_script(_PUT)
        self._touch_script = self._client.register_script(_TOUCH)
        self._pin_script = self._client.register_script(_PIN)
        self._drop_script = self._client.register_script(_DROP)
        self._reap_script = self._client.register_script(_REAP)
        self._add_documents_script = self._client.register_script(_ADD_DOCUMENTS)
        self._breaker = _Breaker(backoff_s, max_backoff_s)
        self._warnings = _Warnings(warn_every_s)
        self._counters = TierCounters(extra=_EXTRA_COUNTERS)
        self._writer = BackgroundWriter(
            self._apply, name="kvboost-redis-writer", background=background_writes,
            max_items=max_pending_writes, max_bytes=max_pending_bytes,
        )
        self._closed = False
        close_at_exit(self)

    # -- KVStore -----------------------------------------------------------------------------

    def get(self, key: str) -> Hit | None:
        chunk = None
        try:
            data = self._call("read", lambda: self._client.get(self._base + key))
            if data is not None:
                chunk = _decode(data, self.namespace, key)
        except _Unavailable:
            pass
        except (CorruptEntryError, _WrongType) as e:
            self._drop_corrupt(key, str(e))
        self._counters.read(found=chunk is not None)
        if chunk is None:
            return None
        self._writer.submit(("touch", key, time.time()))
        return Hit(chunk, self.name)

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        if self._closed:
            return
        if not self._writer.submit(("put", key, chunk, pin), chunk.nbytes):
            self._counters.add("dropped_writes")
            self._warnings.warn(
                "queue",
                "redis tier write-back queue is full (Redis is slower than generation); dropped %s…",
                key[:12],
            )

    def contains(self, key: str) -> bool:
        try:
            return bool(self._call("exists", lambda: self._client.exists(self._base + key)))
        except (_Unavailable, _WrongType):
            return False

    def pin(self, key: str, pinned: bool = True) -> bool:
        self.flush()
        keys = [self._base + key, self._meta["pinned"]]
        args = [key, int(pinned), self._ttl_ms()]
        try:
            found = self._call("pin", lambda: self._pin_script(keys=keys, args=args))
        except (_Unavailable, _WrongType):
            return False
        return bool(found)

    def stats(self) -> dict[str, TierStats]:
        self.flush()
        if self.ttl_s is not None:
            self._reap_expired()
        s = self._counters.snapshot()

        def read_totals() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.zcard(self._meta["lru"]).get(self._meta["bytes"]).scard(self._meta["pinned"])
            return pipe.execute()

        try:
            entries, nbytes, pinned = self._call("stats", read_totals)
            s.entries, s.bytes, s.pinned = int(entries), int(nbytes or 0), int(pinned)
        except (_Unavailable, _WrongType, ValueError):
            pass  # the shared totals are unknown while Redis is away; this process's counters stand
        s.extra = self._counters.snapshot().extra  # counted while reading the totals
        return {self.name: s}

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        try:
            self._client.close()
        except Exception:  # closing sockets of a server that went away: nothing left to do
            pass
        closed(self)

    # -- maintenance -------------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        """Delete one entry (payload and records); returns whether its payload was there."""
        self.flush()
        try:
            present = bool(self._call("remove", lambda: self._client.exists(self._base + key)))
            return present and self._drop(key)
        except (_Unavailable, _WrongType):
            return False

    def shared_records(self) -> RedisRecords:
        """The document registry's records in Redis, for :class:`~kvboost_rag.registry.DocumentRegistry`."""
        return RedisRecords(self)

    @property
    def available(self) -> bool:
        """False while Redis is skipped after a failure (the back-off period)."""
        return self._breaker.allow()

    # -- internals ---------------------------------------------------------------------------

    def _ttl_ms(self) -> int:
        return 0 if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one Redis operation; raises :class:`_Unavailable` when skipped or failed."""
        if not self._breaker.allow():
            self._counters.add("skipped")
            raise _Unavailable
        try:
            result = fn()
        except redis.ResponseError as e:
            if str(e).startswith("WRONGTYPE"):
                self._breaker.success()
                raise _WrongType(f"not a string value ({e})") from e
            self._failed(what, e)
            raise _Unavailable from e
        except Exception as e:
            # Anything else is a transport problem, a timeout or a reply we cannot parse.
            # Whatever it is, Redis is a cache: the request goes on without it.
            self._failed(what, e)
            raise _Unavailable from e
        self._breaker.success()
        return result

    def _failed(self, what: str, e: BaseException) -> None:
        pause = self._breaker.failure()
        self._counters.add("errors")
        self._warnings.warn(
            "error",
            "redis tier %s at %s failed (%s: %s); skipping Redis for %.1f s, requests go on without it",
            what, self.server, type(e).__name__, e, pause,
        )

    def _apply(self, item: tuple) -> None:
        kind = item[0]
        try:
            if kind == "put":
                self._write(*item[1:4])
            elif kind == "touch":
                _, key, now = item
                keys = [self._base + key, self._meta["lru"], self._meta["pinned"]]
                self._call("touch", lambda: self._touch_script(keys=keys, args=[key, now, self._ttl_ms()]))
            elif kind == "drop":
                self._drop(item[1])
            elif kind == "documents":
                args = [x for text in item[1] for x in (hashlib.sha256(text.encode()).hexdigest(), text)]
                keys = [self._meta["docs"], self._meta["doc-ids"]]
                self._call("registry write", lambda: self._add_documents_script(keys=keys, args=args))
            elif kind == "sources":
                mapping = {k: f"{s.start}:{s.prefix_key}" for k, s in item[1].items()}
                sources = self._meta["sources"]
                self._call("registry write", lambda: self._client.hset(sources, mapping=mapping))
        except (_Unavailable, _WrongType):
            pass  # counted and logged by _call; a cache write that did not happen

    def _write(self, key: str, chunk: StoredChunk, pin: bool) -> None:
        data = encode(chunk, self.namespace, key)
        keys = [self._base + key, *(self._meta[m] for m in ("sizes", "lru", "bytes", "pinned"))]
        limit = -1 if self.max_bytes is None else self.max_bytes
        args = [data, key, time.time(), self._ttl_ms(), int(pin), limit, self._base]
        evicted, expired = self._call("write", lambda: self._put_script(keys=keys, args=args))
        self._counters.add("puts")
        self._counters.add("evictions", int(evicted))
        self._counters.add("expired", int(expired))

    def _drop(self, key: str) -> bool:
        keys = [self._base + key, *(self._meta[m] for m in ("sizes", "lru", "bytes", "pinned"))]
        self._call("delete", lambda: self._drop_script(keys=keys, args=[key]))
        return True

    def _drop_corrupt(self, key: str, reason: str) -> None:
        self._counters.add("corrupt")
        self._warnings.warn(
            "corrupt", "redis tier entry %s… is unusable (%s); removed, it will be recomputed",
            key[:12], reason,
        )
        self._writer.submit(("drop", key))

    def _reap_expired(self) -> None:
        """Forget the size and access records of entries whose payload expired (keeps the totals right)."""
        assert self.ttl_s is not None
        cutoff = time.time() - self.ttl_s
        keys = [self._meta["sizes"], self._meta["lru"], self._meta["bytes"]]
        try:
            gone = self._call("stats", lambda: self._reap_script(keys=keys, args=[cutoff, self._base, 1000]))
        except (_Unavailable, _WrongType):
            return
        self._counters.add("expired", int(gone))


class RedisRecords:
    """The shared part of the document registry: document texts and blend sources of one namespace.

    Writes go through the store's write-back queue; reads are single quick calls that
    come back empty while Redis is away. :meth:`new_documents` asks Redis at most every
    ``registry_refresh_s`` seconds, so a document pre-warmed elsewhere is found within
    that delay. The records are small; they never expire and are not counted in
    ``max_bytes`` (a document whose KV is gone is simply a miss and computed again).
    """

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._cursor = 0
        self._next_poll = 0.0
        self._lock = threading.Lock()

    def publish_documents(self, texts: Sequence[str]) -> None:
        """Add document texts (already normalized) to the namespace's shared list."""
        texts = [t for t in dict.fromkeys(texts) if len(t) >= ANCHOR_CHARS]
        if texts and not self._store._writer.submit(("documents", texts)):
            self._store._counters.add("dropped_writes")

    def new_documents(self) -> list[str]:
        """Documents added by any process since the last call; polls at most every ``registry_refresh_s``."""
        store = self._store
        with self._lock:
            now = time.monotonic()
            if now < self._next_poll:
                return []
            self._next_poll = now + store.registry_refresh_s
            cursor, docs = self._cursor, store._meta["docs"]
            try:
                raw = store._call("registry read", lambda: store._client.lrange(docs, cursor, -1))
            except (_Unavailable, _WrongType):
                return []
            self._cursor = cursor + len(raw)
        texts = []
        for item in raw:
            try:
                texts.append(item.decode("utf-8") if isinstance(item, (bytes, bytearray)) else str(item))
            except UnicodeDecodeError:
                store._counters.add("corrupt")
        return texts

    def publish_sources(self, sources: Mapping[str, Source]) -> None:
        """Record where document chunks are stored, by content key (blend mode)."""
        if sources and not self._store._writer.submit(("sources", dict(sources))):
            self._store._counters.add("dropped_writes")

    def source(self, content_key: str) -> Source | None:
        """The stored location of a document chunk, if any process recorded one."""
        store, sources = self._store, self._store._meta["sources"]
        try:
            raw = store._call("registry read", lambda: store._client.hget(sources, content_key))
        except (_Unavailable, _WrongType):
            return None
        if raw is None:
            return None
        try:
            start, prefix_key = bytes(raw).decode("ascii").split(":", 1)
            return Source(prefix_key, int(start))
        except (UnicodeDecodeError, ValueError, TypeError):
            store._counters.add("corrupt")
            return None


def _decode(data: Any, namespace: str, key: str) -> StoredChunk:
    """Check and decode a value read from Redis; anything wrong with it is a :class:`CorruptEntryError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptEntryError(f"Redis returned a {type(data).__name__}, not bytes")
    try:
        return decode(data, namespace, key)
    except CorruptEntryError:
        raise
    except Exception as e:  # a value crafted or mangled so that even the checks trip: still only a miss
        raise CorruptEntryError(f"undecodable value ({type(e).__name__}: {e})") from e


def _connect(
    url: str,
    password: str | None,
    tls: dict[str, str],
    options: dict[str, Any],
    connect_timeout_s: float,
    timeout_s: float,
) -> redis.Redis:
    if tls and not url.startswith("rediss://"):
        msg = f"TLS settings ({', '.join(tls)}) need a rediss:// URL; got {url.split('://', 1)[0]}://"
        raise ValueError(msg)
    settings: dict[str, Any] = dict(
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=timeout_s,
        # No client-side retries: the back-off decides when Redis is tried again, and a
        # retry would multiply the time a request can spend on a dead server.
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    if password is not None:
        settings["password"] = password
    settings.update(tls)
    settings.update(options)  # the caller's word wins, timeouts included
    try:
        return redis.Redis.from_url(url, **settings)
    except ValueError as e:
        msg = f"bad Redis URL ({e}); use redis://[[user]:password@]host:port/db or rediss://... for TLS"
        raise ValueError(msg) from e


def _describe(client: redis.Redis) -> str:
    kw = client.get_connection_kwargs()
    where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
    return f"{where}/{kw.get('db', 0)}"
