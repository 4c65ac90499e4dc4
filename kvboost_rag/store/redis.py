"""Remote tier: chunk KV in Redis, shared by every worker process that can reach the server.

- Payloads are the disk tier's checked raw-buffer format (:mod:`.serialization`), never
  pickled; every read is checked against the namespace and key it was read under.
- Keys are ``{key_prefix}:{namespace}:{key}``; a few bookkeeping keys per namespace hold entry
  sizes, last access times, the byte total and the pins, kept consistent with the payloads
  by small Lua scripts, atomically, whichever process writes (:mod:`.redis_scripts`).
- Writes are write-back on a background thread behind a bounded queue: ``put`` returns at
  once, and when the queue is full the write is dropped (counted, logged) rather than
  making generation wait. :meth:`RedisStore.flush` waits for the queue.
- Redis is a cache here, so it may fail in any way without failing a request: down, slow
  or returning garbage, a read is a miss and a write is dropped, both counted in
  ``stats()["redis"].extra`` and logged at most every ``warn_every_s`` per kind of
  problem. Every call runs under short socket timeouts and without client-side retries,
  and after a failure the tier is skipped for a back-off period (doubling while failures
  repeat), so a dead server costs one timeout per period instead of one per chunk
  (:mod:`.resilience`).
- ``ttl_s`` sets an expiry on every write and renews it on every read (a sliding expiry:
  documents that keep being used stay). Pinned entries never expire and are never
  evicted. ``max_bytes`` bounds a namespace's payload bytes: beyond it, unpinned entries
  are evicted least recently used first.
- :meth:`RedisStore.shared_records` gives the document registry's shared part
  (:class:`~.redis_records.RedisRecords`), so a flat prompt can be split at documents that
  another process pre-warmed.

- On a Redis Cluster (or a Valkey cluster; ``cluster=True``) a namespace's entries spread over
  ``cluster_shards`` shards, each in one hash slot with its own records, so every script runs
  on one node; eviction and pinning hold per shard (:mod:`.redis_scripts`). A node that is
  down makes its shards' reads misses until it is back, like a standalone server that is down.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar, cast

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AskError, ClusterCrossSlotError, ClusterDownError

from ..config import check_secret
from ..registry import Source
from .base import Hit, StoredChunk, TierCounters, TierStats
from .codecs import codec_named
from .redis_options import RedisOptions, describe, describe_url
from .redis_records import RedisRecords
from .redis_scripts import NamespaceKeys, Scripts
from .resilience import CircuitBreaker, ForeignEntries, RateLimitedWarnings
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
from .writer import WriteBehindTier, WriteOp

__all__ = ["RedisOptions", "RedisRecords", "RedisStore"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_EXTRA_COUNTERS = ("errors", "corrupt", "foreign", "skipped", "dropped_writes", "expired")
"""``stats()["redis"].extra``: failed calls, unusable values (counted misses, removed), entries signed
otherwise than this tier signs (counted misses, kept), calls skipped while backing off, writes
dropped for a full queue, and records of expired entries forgotten."""


_CLUSTER_REPLIES = (AskError, ClusterCrossSlotError, ClusterDownError)
"""What a cluster node answers a client that does not follow the slot map (MOVED is an AskError)."""


class _Unavailable(Exception):
    """Redis was skipped (back-off) or failed; the caller falls back to a miss."""


class _WrongType(Exception):
    """A key of ours holds a value of another Redis type: garbage, handled like a corrupt entry."""


class RedisStore(WriteBehindTier):
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
        client: redis.Redis | RedisCluster | None = None,
        options: RedisOptions | None = None,
        secret: Secrets = None,
        codec: str = "raw",
        **settings: Any,
    ) -> None:
        """
        Args:
            url: server address; ``options.password`` is used when the URL carries none.
            namespace: the engine's store namespace (model, tokenizer, dtype, layout).
            client: an existing client, instead of ``url`` and the connection settings.
            options: the tier's settings (:class:`~.redis_options.RedisOptions`).
            secret: store secret: entries are signed with it, and read only when signed with it
                (a client of the server that lacks it cannot make this tier serve its KV); several
                during a rotation (the first signs, any of them verifies).
            codec: how entries are written (:mod:`.codecs`); entries of every codec are read, those
                of an approximate one only when ``codec`` is approximate too.
            settings: single :class:`~.redis_options.RedisOptions` fields, over ``options``
                (``ttl_s=60``, ``max_bytes=...``, ``timeout_s=...``).
        """
        if (url is None) == (client is None):
            raise ValueError("pass either a Redis url or a client")
        self.secrets = tuple(check_secret(s) for s in secrets_of(secret))
        self.codec = codec_named(codec)
        self.options = replace(options or RedisOptions(), **settings)
        o = self.options
        self.namespace = namespace
        self.key_prefix, self.ttl_s, self.max_bytes = o.key_prefix, o.ttl_s, o.max_bytes
        self.registry_refresh_s = o.registry_refresh_s
        self._open: Callable[[], redis.Redis | RedisCluster] | None = None
        if client is None:
            url = cast(str, url)  # the check above: a url when there is no client
            o.check_url(url)
            self.server = describe_url(url)
            """``host:port/db`` of the server, without credentials (for messages)."""
            if o.cluster:  # a cluster client reads the slot map as it is made: wait for the first call
                self._open = partial(o.connect, url)
            else:
                client = o.connect(url)
        else:
            if client.get_connection_kwargs().get("decode_responses"):
                msg = "the Redis client decodes responses to str; KV payloads need decode_responses=False"
                raise ValueError(msg)
            self.server = describe(client)
        self.cluster = o.cluster or isinstance(client, RedisCluster)
        """Whether entries spread over hash-tagged shards for a cluster."""
        self._client_opened = client
        self._scripts_made: Scripts | None = None
        self._open_lock = threading.Lock()
        self._keys = NamespaceKeys(o.key_prefix, namespace, shards=o.cluster_shards if self.cluster else None)
        self._breaker = CircuitBreaker(o.backoff_s, o.max_backoff_s)
        self._warnings = RateLimitedWarnings(logger, o.warn_every_s)
        self._counters = TierCounters(extra=_EXTRA_COUNTERS)
        self._foreign = ForeignEntries(logger, self.name, self._counters)
        self._start_writer(
            "kvboost-redis-writer",
            background=o.background_writes,
            max_items=o.max_pending_writes,
            max_bytes=o.max_pending_bytes,
        )

    # -- KVStore -----------------------------------------------------------------------------

    def get(self, key: str) -> Hit | None:
        entry: Entry | None = None
        try:
            data = self._call("read", lambda: self._client.get(self._keys.entry(key)))
            if data is not None:
                entry = servable(decode_entry(data, self.namespace, key, secret=self.secrets), self.codec)
        except _Unavailable:
            pass
        except (CorruptEntryError, _WrongType) as e:
            self._drop_corrupt(key, str(e))
        except ForeignEntryError as e:
            self._foreign.seen(key, str(e))
        self._counters.read(found=entry is not None)
        if entry is None:
            return None
        self._writer.submit(
            self._op("touch", partial(self._scripts.touch, key, now=time.time(), ttl_ms=self.options.ttl_ms))
        )
        return Hit(entry.chunk, self.name, entry.cost)

    def put(self, key: str, chunk: StoredChunk, *, cost: float = 1.0, pin: bool = False) -> None:
        if self._closed:
            return
        if not self._writer.submit(partial(self._write, key, chunk, cost, pin), chunk.nbytes):
            self._counters.add("dropped_writes")
            self._warnings.warn(
                "queue",
                "redis tier write-back queue is full (Redis is slower than generation); dropped %s…",
                key[:12],
            )

    def contains(self, key: str) -> bool:
        return bool(self._attempt("exists", lambda: self._client.exists(self._keys.entry(key)), 0))

    def pin(self, key: str, pinned: bool = True) -> bool:
        self.flush()
        return self._attempt("pin", lambda: self._scripts.pin(key, pinned, ttl_ms=self.options.ttl_ms), False)

    def remove(self, key: str) -> bool:
        """Delete one entry (payload and records); returns whether its payload was there."""
        self.flush()
        try:
            if not self._call("remove", lambda: self._client.exists(self._keys.entry(key))):
                return False
            self._call("delete", lambda: self._scripts.drop(key))
        except (_Unavailable, _WrongType):
            return False
        return True

    def clear(self) -> None:
        """Delete every entry of this namespace: payloads, sizes, access times and pins.

        The shared registry records stay (other processes read the document list by position).
        Best effort, like every call here: while Redis is away nothing is deleted (counted, logged).
        """
        self.flush()
        keep = {k.encode() for k in self._keys.registry}

        def delete_all() -> None:
            # a cluster client scans every primary
            found = self._client.scan_iter(match=self._keys.scan_pattern, count=1000)
            doomed = [k for k in found if k not in keep]
            for i in range(0, len(doomed), 1000):
                self._client.delete(*doomed[i : i + 1000])  # a cluster client splits it by slot

        self._attempt("clear", delete_all, None)

    def stats(self) -> dict[str, TierStats]:
        self.flush()
        if self.ttl_s is not None:
            cutoff = time.time() - self.ttl_s  # records of entries not read since may have expired
            self._counters.add("expired", self._attempt("stats", lambda: self._scripts.reap(cutoff, 1000), 0))
        s = self._counters.snapshot()

        def read_totals() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for shard in self._keys.shards:
                pipe.zcard(shard.lru)
                pipe.get(shard.bytes)
                pipe.scard(shard.pinned)
            return pipe.execute()

        try:
            totals = self._call("stats", read_totals)  # (entries, bytes, pins) of each shard in turn
            s.entries = sum(int(n) for n in totals[0::3])
            s.bytes = sum(int(n or 0) for n in totals[1::3])
            s.pinned = sum(int(n) for n in totals[2::3])
        except (_Unavailable, _WrongType, ValueError):
            pass  # the shared totals are unknown while Redis is away; this process's counters stand
        s.extra = self._counters.snapshot().extra  # counted while reading the totals
        return {self.name: s}

    def shared_records(self) -> RedisRecords:
        """The document registry's records in Redis, for :class:`~kvboost_rag.registry.DocumentRegistry`."""
        return RedisRecords(self)

    @property
    def available(self) -> bool:
        """False while Redis is skipped after a failure (the back-off period)."""
        return self._breaker.allow()

    # -- shared registry records (what RedisRecords calls) -----------------------------------

    def add_documents(self, texts: Sequence[str]) -> None:
        """Queue appending document texts to the namespace's shared list (each text once, whoever adds it)."""
        self._submit_record(self._op("registry write", partial(self._scripts.add_documents, list(texts))))

    def documents_from(self, start: int) -> tuple[int, list[str]] | None:
        """The shared document list from position ``start`` on: (items read, the texts among them that
        decode); None while Redis is away."""
        raw = self._attempt("registry read", lambda: self._client.lrange(self._keys.docs, start, -1), None)
        if raw is None:
            return None
        texts = []
        for item in raw:
            try:
                texts.append(item.decode("utf-8") if isinstance(item, (bytes, bytearray)) else str(item))
            except UnicodeDecodeError:
                self._counters.add("corrupt")
        return len(raw), texts

    def add_sources(self, sources: Mapping[str, Source]) -> None:
        """Queue recording where document chunks are stored, by content key (the latest record wins)."""
        mapping: dict[Any, Any] = {
            k: f"{s.start}:{s.prefix_key}" for k, s in sources.items()
        }  # redis-py's key type
        self._submit_record(
            self._op("registry write", partial(self._client.hset, self._keys.sources, mapping=mapping))
        )

    def sources(self, content_keys: Sequence[str]) -> dict[str, Source]:
        """The recorded locations of document chunks, by content key (one call); the unknown ones are
        absent, and all are while Redis is away."""
        keys = list(content_keys)
        if not keys:
            return {}
        raw = self._attempt("registry read", lambda: self._client.hmget(self._keys.sources, keys), None)
        found: dict[str, Source] = {}
        for key, value in zip(keys, raw or [], strict=False):
            if value is None:
                continue
            try:
                text = value.decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)
                start, prefix_key = text.split(":", 1)
                found[key] = Source(prefix_key, int(start))
            except (UnicodeDecodeError, ValueError, TypeError):
                self._counters.add("corrupt")
        return found

    # -- internals ---------------------------------------------------------------------------

    @property
    def _client(self) -> redis.Redis | RedisCluster:
        """The client; a cluster's is made on first use (inside a call, so failing is a miss)."""
        client = self._client_opened
        if client is None:
            with self._open_lock:
                if self._client_opened is None:
                    self._client_opened = cast(Callable[[], Any], self._open)()
                client = self._client_opened
        return client

    @property
    def _scripts(self) -> Scripts:
        scripts = self._scripts_made
        if scripts is None:
            scripts = self._scripts_made = Scripts(self._client, self._keys)
        return scripts

    def _release(self) -> None:
        if self._client_opened is not None:
            with contextlib.suppress(Exception):  # closing sockets of a server that went away: nothing to do
                self._client_opened.close()

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

    def _attempt(self, what: str, fn: Callable[[], T], default: T) -> T:
        """:meth:`_call`, giving ``default`` when Redis is away or a key holds a value of another type."""
        try:
            return self._call(what, fn)
        except (_Unavailable, _WrongType):
            return default  # counted and logged by _call

    def _op(self, what: str, fn: Callable[[], object]) -> WriteOp:
        """A write-back of ``fn``: on the writer thread, a failure is counted and logged, never raised."""
        return partial(self._attempt, what, fn, None)

    def _submit_record(self, op: WriteOp) -> None:
        if not self._writer.submit(op):
            self._counters.add("dropped_writes")

    def _failed(self, what: str, e: BaseException) -> None:
        pause = self._breaker.failure()
        self._counters.add("errors")
        if not self.cluster and isinstance(e, _CLUSTER_REPLIES):
            self._warnings.warn(
                "cluster",
                "redis tier at %s: the server is a Redis Cluster node (%s); "
                "set redis_options={'cluster': True}",
                self.server,
                type(e).__name__,
            )
            return
        self._warnings.warn(
            "error",
            "redis tier %s at %s failed (%s: %s); skipping Redis for %.1f s, requests go on without it",
            what,
            self.server,
            type(e).__name__,
            e,
            pause,
        )

    def _write(self, key: str, chunk: StoredChunk, cost: float, pin: bool) -> None:
        """Store one entry, evicting down to ``max_bytes`` (a queued write)."""
        if key in self._foreign:
            return
        data = encode(chunk, self.namespace, key, cost, secret=self.secrets, codec=self.codec)
        now, ttl_ms = time.time(), self.options.ttl_ms
        written = self._attempt(
            "write",
            lambda: self._scripts.put(key, data, now=now, ttl_ms=ttl_ms, pin=pin, max_bytes=self.max_bytes),
            None,
        )
        if written is not None:
            evicted, expired = written
            self._counters.add("puts")
            self._counters.add("evictions", evicted)
            self._counters.add("expired", expired)

    def _drop_corrupt(self, key: str, reason: str) -> None:
        self._counters.add("corrupt")
        self._warnings.unusable_entry(self.name, key, reason)
        self._writer.submit(self._op("delete", partial(self._scripts.drop, key)))
