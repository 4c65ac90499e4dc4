"""The Redis tier's key layout, and the Lua scripts that keep its bookkeeping consistent with the payloads.

A namespace's entries live in shards (one on a standalone server, ``cluster_shards`` on a
cluster; :class:`NamespaceKeys`). An entry's payload is at its shard's base plus the prefix key.
Beside them, each shard's bookkeeping keys hold entry sizes (``#sizes``, a hash), last access
times (``#lru``, a sorted set), the byte total (``#bytes``) and the pins (``#pinned``, a set).
The shared registry records are document texts (``#docs``, a list, and ``#doc-ids``, the set of
their digests) and blend sources (``#sources``, a hash). ``#`` never starts a prefix key (hex),
so they cannot collide with entries.

Each script runs atomically on the server and touches the keys of one shard only (one slot on a
cluster), so the records stay right whichever process writes.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence
from typing import Any

# KEYS: payload, sizes, lru, bytes, pinned
# ARGV: data, member, now, ttl_ms (0: none), pin (0/1), max_bytes (-1: none), payload key prefix
# Returns {evicted, expired}: entries removed for space, and stale records of expired entries.
PUT = """
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
TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 'XX', ARGV[2], ARGV[1])
if tonumber(ARGV[3]) > 0 and redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
"""

# KEYS: payload, pinned.  ARGV: member, pin (0/1), ttl_ms (0: none).  Returns whether the entry exists.
PIN = """
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
DROP = """
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
REAP = """
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
ADD_DOCUMENTS = """
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[1], ARGV[i + 1])
    added = added + 1
  end
end
return added
"""


class ShardKeys:
    """The keys of one shard: the payloads of the entries that map to it, and their bookkeeping.

    Every key of a shard starts with ``base``, so on a cluster they share one hash slot and a
    script may touch any of them.
    """

    def __init__(self, base: str) -> None:
        self.base = base
        """What every key of the shard starts with; an entry's payload key is ``base + key``."""
        self.sizes, self.lru, self.bytes, self.pinned = (
            base + n for n in ("#sizes", "#lru", "#bytes", "#pinned")
        )

    def entry(self, key: str) -> str:
        return self.base + key

    def entry_records(self, key: str) -> list[str]:
        """The keys a write or a delete of one entry touches: payload, sizes, lru, bytes, pinned."""
        return [self.entry(key), self.sizes, self.lru, self.bytes, self.pinned]


class NamespaceKeys:
    """The Redis key names of one namespace.

    On a standalone server (``shards=None``) the namespace is one shard whose keys start with
    ``{key_prefix}:{namespace}:``:

    >>> keys = NamespaceKeys("kvboost", "ns")
    >>> keys.entry("ab12"), keys.shard("ab12").lru
    ('kvboost:ns:ab12', 'kvboost:ns:#lru')

    On a cluster, entries spread over ``shards`` shards by a hash of their key. A shard's keys
    start with a hash tag of its own (a digest of the namespace and the shard's number, in
    braces, first, so that no brace in the prefix or the namespace can move it): the cluster
    keeps each shard in one slot and spreads the shards over its nodes. The registry records
    have a tag of their own.

    >>> keys = NamespaceKeys("kvboost", "ns", shards=16)
    >>> keys.entry("ab12")
    '{a5f54319.6}kvboost:ns:ab12'
    >>> keys.docs
    '{a5f54319.r}kvboost:ns:#docs'
    """

    def __init__(self, key_prefix: str, namespace: str, *, shards: int | None = None) -> None:
        name = f"{key_prefix}:{namespace}:"
        if shards is None:
            self.shards: tuple[ShardKeys, ...] = (ShardKeys(name),)
            registry_base = name
            self.scan_pattern = _glob_escape(name) + "*"
        else:
            if shards < 1:
                raise ValueError(f"shards={shards}: a cluster namespace needs at least one shard")
            tag = hashlib.sha256(name.encode()).hexdigest()[:8]
            self.shards = tuple(ShardKeys(f"{{{tag}.{s}}}{name}") for s in range(shards))
            registry_base = f"{{{tag}.r}}{name}"
            self.scan_pattern = f"{{{tag}.*}}{_glob_escape(name)}*"
        """A SCAN pattern that matches every key of the namespace (and no other namespace's)."""
        self.docs, self.doc_ids, self.sources = (registry_base + n for n in ("#docs", "#doc-ids", "#sources"))

    def shard(self, key: str) -> ShardKeys:
        """The shard that holds entry ``key``."""
        if len(self.shards) == 1:
            return self.shards[0]
        return self.shards[zlib.crc32(key.encode()) % len(self.shards)]

    def entry(self, key: str) -> str:
        return self.shard(key).entry(key)

    @property
    def registry(self) -> tuple[str, ...]:
        """The shared registry records (kept by :meth:`RedisStore.clear`)."""
        return (self.docs, self.doc_ids, self.sources)


class Scripts:
    """The scripts, registered on one client and called with one namespace's keys.

    Each method is one Redis round trip; errors are the client's (the tier decides what they mean).
    """

    def __init__(self, client: Any, keys: NamespaceKeys) -> None:
        self.keys = keys
        self._put = client.register_script(PUT)
        self._touch = client.register_script(TOUCH)
        self._pin = client.register_script(PIN)
        self._drop = client.register_script(DROP)
        self._reap = client.register_script(REAP)
        self._add_documents = client.register_script(ADD_DOCUMENTS)

    def put(
        self, key: str, data: bytes, *, now: float, ttl_ms: int, pin: bool, max_bytes: int | None
    ) -> tuple[int, int]:
        """Store a payload and its records, evicting down to ``max_bytes``; returns (evicted, expired)."""
        shard = self.keys.shard(key)
        # each shard evicts within its share of the budget: a script sees the keys of one shard only
        limit = -1 if max_bytes is None else max_bytes // len(self.keys.shards)
        args = [data, key, now, ttl_ms, int(pin), limit, shard.base]
        evicted, expired = self._put(keys=shard.entry_records(key), args=args)
        return int(evicted), int(expired)

    def touch(self, key: str, *, now: float, ttl_ms: int) -> bool:
        """Renew an entry's access time (and expiry, unless pinned); False when it is gone."""
        shard = self.keys.shard(key)
        return bool(self._touch(keys=[shard.entry(key), shard.lru, shard.pinned], args=[key, now, ttl_ms]))

    def pin(self, key: str, pinned: bool, *, ttl_ms: int) -> bool:
        """Pin (no expiry, never evicted) or unpin an entry; returns whether it exists."""
        shard = self.keys.shard(key)
        return bool(self._pin(keys=[shard.entry(key), shard.pinned], args=[key, int(pinned), ttl_ms]))

    def drop(self, key: str) -> int:
        """Delete an entry and its records; returns the bytes it was recorded with."""
        return int(self._drop(keys=self.keys.shard(key).entry_records(key), args=[key]))

    def reap(self, cutoff: float, limit: int) -> int:
        """Forget the records of entries read last before ``cutoff`` whose payload expired (at most
        ``limit`` looked at per shard); how many went."""
        gone = 0
        for shard in self.keys.shards:
            keys = [shard.sizes, shard.lru, shard.bytes]
            gone += int(self._reap(keys=keys, args=[cutoff, shard.base, limit]))
        return gone

    def add_documents(self, texts: Sequence[str]) -> int:
        """Append the texts not listed yet to the shared document list; returns how many were new."""
        args = [x for text in texts for x in (hashlib.sha256(text.encode()).hexdigest(), text)]
        return int(self._add_documents(keys=[self.keys.docs, self.keys.doc_ids], args=args))


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis SCAN pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)
