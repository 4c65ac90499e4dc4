"""KV payload format: tensor bytes behind a small checked header. Never pickle.

Layout of one entry (little-endian)::

    b"KVB2" | u32 header_bytes | header (JSON, UTF-8) | 16-byte XXH3-128 digest | kv bytes | logits bytes

The header names the namespace, the key, shapes, dtypes, the codec of the KV bytes
(:mod:`.codecs`; raw when absent), the chunk's lineage and its recompute cost (kept for
eviction when an entry moves between tiers); the digest covers the header and the
payload. :func:`decode` checks all of them,
so a corrupt, truncated or foreign entry is refused instead of served. XXH3 runs
at ~14 GB/s here, so checking costs far less than reading the bytes.

The digest detects damage, not forgery: anyone who can write the store can compute it.
A store shared with writers that are not trusted takes a *store secret*: entries are then
signed (magic ``b"KVS2"``, a 32-byte HMAC-SHA256 after the digest, over everything but the
two checks). HMAC-SHA256 runs at ~1.5 GB/s here (SHA-NI), so signing is opt-in.

An intact entry (its digest holds) that is signed otherwise than the reader signs (under
another secret; unsigned where the reader has secrets; signed where it has none) is
*foreign* (:class:`ForeignEntryError`): this reader cannot trust it, but it is not damaged,
and another process may: it is a miss, never removed for it. During a rotation a reader
takes several secrets (the first signs; any of them verifies).

>>> import torch
>>> chunk = StoredChunk(torch.arange(24, dtype=torch.float32).reshape(1, 2, 1, 3, 4))
>>> back = decode(encode(chunk, "ns", "k"), "ns", "k")
>>> torch.equal(back.kv, chunk.kv), back.last_logits is None
(True, True)
>>> signed = encode(chunk, "ns", "k", secret=b"s" * 32)
>>> decode(signed, "ns", "k", secret=b"x" * 32)
Traceback (most recent call last):
...
kvboost_rag.store.serialization.ForeignEntryError: signed under another store secret
>>> small = decode(encode(chunk, "ns", "k", codec=codec_named("int8")), "ns", "k")
>>> small.approximate, small.kv.shape == chunk.kv.shape
(True, True)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import xxhash

from ..errors import KVBoostError
from .base import StoredChunk
from .codecs import RAW, Codec, codec_named, raw_bytes

MAGIC = b"KVB2"
SIGNED_MAGIC = b"KVS2"
_DIGEST_BYTES = 16
_MAC_BYTES = 32
_HEADER_LEN = struct.Struct("<I")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class CorruptEntryError(KVBoostError, ValueError):
    """A stored entry failed a check (format, namespace, key, shape, dtype or checksum)."""


class ForeignEntryError(KVBoostError, ValueError):
    """An intact entry signed otherwise than this reader signs: a miss for it, not damage."""


Secrets = bytes | Sequence[bytes] | None
"""A store secret, several (a rotation: the first signs, any verifies), or none."""


def secrets_of(secret: Secrets) -> tuple[bytes, ...]:
    """``secret`` as a tuple, the signing one first.

    >>> secrets_of(None), secrets_of(b"a"), secrets_of([b"a", b"b"])
    ((), (b'a',), (b'a', b'b'))
    """
    if secret is None:
        return ()
    if isinstance(secret, (bytes, bytearray)):
        return (bytes(secret),)
    return tuple(bytes(s) for s in secret)


class Entry(NamedTuple):
    """A decoded entry."""

    chunk: StoredChunk
    cost: float | None
    """The recompute cost it was stored with; None for an entry written before costs were stored."""


def _signature(secret: bytes, framing: memoryview | bytes, payload: Iterable[bytes | memoryview]) -> bytes:
    mac = hmac.new(secret, framing, hashlib.sha256)
    for part in payload:
        mac.update(part)
    return mac.digest()


def encode(
    chunk: StoredChunk,
    namespace: str,
    key: str,
    cost: float = 1.0,
    *,
    secret: Secrets = None,
    codec: Codec = RAW,
) -> bytes:
    """The entry's bytes: checked header, then the KV in ``codec`` and the raw logits; signed with
    ``secret`` (the first, when several)."""
    kv = b"".join(codec.encode(chunk.kv)) if codec is not RAW else raw_bytes(chunk.kv)
    logits = raw_bytes(chunk.last_logits) if chunk.last_logits is not None else memoryview(b"")
    header = {
        "namespace": namespace,
        "key": key,
        "kv_shape": list(chunk.kv.shape),
        "kv_dtype": str(chunk.kv.dtype).removeprefix("torch."),
        "codec": codec.name,
        "kv_bytes": len(kv),
        "logits_shape": list(chunk.last_logits.shape) if chunk.last_logits is not None else None,
        "payload_bytes": len(kv) + logits.nbytes,
        "token_ids": list(chunk.token_ids) if chunk.token_ids is not None else None,
        "parent_key": chunk.parent_key,
        "cost": float(cost),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    digest = xxhash.xxh3_128(head)
    digest.update(kv)
    digest.update(logits)
    secrets = secrets_of(secret)
    if not secrets:
        return b"".join((MAGIC, _HEADER_LEN.pack(len(head)), head, digest.digest(), kv, logits))
    framing = SIGNED_MAGIC + _HEADER_LEN.pack(len(head)) + head
    mac = _signature(secrets[0], framing, (kv, logits))
    return b"".join((framing, digest.digest(), mac, kv, logits))


def decode(
    data: bytes | bytearray | memoryview, namespace: str, key: str, *, secret: Secrets = None
) -> StoredChunk:
    """Check and decode an entry; tensors are CPU views on ``data`` when it is writable."""
    return decode_entry(data, namespace, key, secret=secret).chunk


def decode_entry(
    data: object, namespace: str, key: str, *, secret: Secrets = None, check_signature: bool = True
) -> Entry:
    """Check and decode a value read from a tier, whatever it is; raises :class:`CorruptEntryError`
    (damage) or :class:`ForeignEntryError` (intact, but signed otherwise than ``secret`` signs: with
    secrets, the entry must be signed with one of them; without, it must be unsigned).
    ``check_signature=False`` checks integrity only (maintenance indexing an entry it never serves).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptEntryError(f"the tier returned a {type(data).__name__}, not bytes")
    try:
        return _decode(memoryview(data), namespace, key, secrets_of(secret) if check_signature else None)
    except (CorruptEntryError, ForeignEntryError):
        raise
    except Exception as e:  # a value crafted or mangled so that even the checks trip: still only a miss
        raise CorruptEntryError(f"undecodable value ({type(e).__name__}: {e})") from e


def servable(entry: Entry | None, codec: Codec) -> Entry | None:
    """``entry``, unless it is approximate and the tier writes with an exact ``codec``: a store is
    served lossy KV only where a lossy codec was chosen for it (the entry stays; it is a miss)."""
    if entry is not None and entry.chunk.approximate and not codec.approximate:
        return None
    return entry


def claimed_owner(data: bytes | bytearray | memoryview) -> tuple[str, str]:
    """The ``(namespace, key)`` an entry's header claims, unchecked: what to check it against when
    nothing else says where it belongs (a payload file that lost its index). Raises
    :class:`CorruptEntryError` when there is no readable header."""
    view = memoryview(data)
    if len(view) < 8 or view[:4] not in (MAGIC, SIGNED_MAGIC):
        raise CorruptEntryError("not a kvboost KV entry (bad magic)")
    (head_len,) = _HEADER_LEN.unpack(view[4:8])
    try:
        header = json.loads(bytes(view[8 : 8 + head_len]))
        return str(header["namespace"]), str(header["key"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntryError(f"unreadable header ({e})") from e


def _decode(view: memoryview, namespace: str, key: str, secrets: tuple[bytes, ...] | None) -> Entry:
    if len(view) < 8 or view[:4] not in (MAGIC, SIGNED_MAGIC):
        raise CorruptEntryError("not a kvboost KV entry (bad magic)")
    signed = view[:4] == SIGNED_MAGIC
    (head_len,) = _HEADER_LEN.unpack(view[4:8])
    head = view[8 : 8 + head_len]
    digest = view[8 + head_len : 8 + head_len + _DIGEST_BYTES]
    mac_end = 8 + head_len + _DIGEST_BYTES + (_MAC_BYTES if signed else 0)
    mac = view[8 + head_len + _DIGEST_BYTES : mac_end]
    payload = view[mac_end:]
    if len(digest) != _DIGEST_BYTES or len(mac) != mac_end - 8 - head_len - _DIGEST_BYTES:
        raise CorruptEntryError("truncated header")
    check = xxhash.xxh3_128(head)
    check.update(payload)
    if check.digest() != digest:
        raise CorruptEntryError("checksum mismatch")
    if secrets is not None:  # intact: a signature that does not verify makes it foreign, not damaged
        _check_signer(
            secrets, signed, lambda secret: _signature(secret, view[: 8 + head_len], (payload,)), mac
        )
    try:
        header = json.loads(bytes(head))
        kv_shape, kv_dtype = tuple(header["kv_shape"]), _DTYPES[header["kv_dtype"]]
        logits_shape = header["logits_shape"]
        expected_bytes = int(header["payload_bytes"])
        codec = codec_named(str(header.get("codec", RAW.name)))  # entries before codecs are raw
        kv_bytes = int(header.get("kv_bytes", kv_dtype.itemsize * _numel(kv_shape)))
        cost = _cost(header.get("cost"))
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntryError(f"unreadable header ({e})") from e
    if header.get("namespace") != namespace or header.get("key") != key:
        raise CorruptEntryError("entry belongs to another namespace or key")
    logits_bytes = 4 * _numel(logits_shape) if logits_shape is not None else 0
    if len(payload) != expected_bytes or expected_bytes != kv_bytes + logits_bytes or len(kv_shape) != 5:
        raise CorruptEntryError(f"truncated or malformed payload ({len(payload)} of {expected_bytes} bytes)")
    if not _numel(kv_shape):
        raise CorruptEntryError("empty KV payload")
    buffer = payload if not payload.readonly else bytearray(payload)  # torch needs a writable buffer
    try:
        kv = codec.decode(memoryview(buffer)[:kv_bytes], kv_shape, kv_dtype)
    except ValueError as e:
        raise CorruptEntryError(f"undecodable {codec.name} payload ({e})") from e
    logits = None
    if logits_shape is not None:
        logits = torch.frombuffer(buffer, dtype=torch.float32, offset=kv_bytes).reshape(logits_shape)
    token_ids = header.get("token_ids")
    if token_ids is not None and len(token_ids) != kv_shape[3]:
        raise CorruptEntryError("token count does not match the KV shape")
    ids = tuple(token_ids) if token_ids is not None else None
    return Entry(StoredChunk(kv, logits, ids, header.get("parent_key"), codec.name), cost)


def _check_signer(
    secrets: tuple[bytes, ...], signed: bool, signature: Callable[[bytes], bytes], mac: memoryview
) -> None:
    """Raise :class:`ForeignEntryError` unless the entry is signed as this reader signs: with one of
    ``secrets``, or not at all when there are none."""
    if secrets and not signed:
        raise ForeignEntryError("unsigned (written without a store secret)")
    if signed and not secrets:
        raise ForeignEntryError("signed (written with a store secret this reader lacks)")
    if secrets and not any(hmac.compare_digest(signature(secret), mac) for secret in secrets):
        raise ForeignEntryError("signed under another store secret")


def _cost(value: object) -> float | None:
    if value is None:
        return None  # written before costs were stored
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"bad cost {value!r}")
    return float(value)


def _numel(shape: Iterable[Any]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
