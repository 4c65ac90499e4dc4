"""KV payload format: bitwise round trips, every check refusing bad input, zero-copy views."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.serialization import (
    MAGIC,
    CorruptEntryError,
    ForeignEntryError,
    decode,
    decode_entry,
    encode,
)

NS, KEY = "model-a|tok-a|float32|v1", "0f" * 32
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_chunk(dtype=torch.float32, logits=False, shape=(2, 2, 3, 5, 8), seed=0):
    """Random KV (with negative zeros, infs and NaNs) so a round trip must keep every bit."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=g).to(dtype)
    flat = kv.view(-1)
    flat[0], flat[1], flat[2], flat[3] = -0.0, float("inf"), float("-inf"), float("nan")
    last = torch.randn(17, generator=g) if logits else None
    return StoredChunk(kv, last)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparison (NaN-safe, -0.0-aware)."""
    return t.contiguous().view(-1).view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


DIGEST_BYTES = 16


def split(data: bytes) -> tuple[dict, int]:
    """(header dict, offset of the payload) of an encoded entry."""
    (n,) = struct.unpack("<I", data[4:8])
    return json.loads(data[8 : 8 + n]), 8 + n + DIGEST_BYTES


def with_header(data: bytes, **changes) -> bytes:
    """The entry with header fields changed and a digest that matches: a well-formed foreign entry."""
    import xxhash

    header, start = split(data)
    header.update(changes)
    head = json.dumps(header, separators=(",", ":")).encode()
    digest = xxhash.xxh3_128(head + bytes(data[start:])).digest()
    return MAGIC + struct.pack("<I", len(head)) + head + digest + data[start:]


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["no-logits", "logits"])
def test_round_trip_is_bitwise(dtype, logits):
    chunk = make_chunk(dtype, logits)
    data = encode(chunk, NS, KEY)
    assert isinstance(data, bytes) and data[:4] == MAGIC
    back = decode(data, NS, KEY)
    assert_bitwise(back.kv, chunk.kv)
    assert back.num_tokens == chunk.num_tokens
    if logits:
        assert back.last_logits is not None
        assert_bitwise(back.last_logits, chunk.last_logits)
    else:
        assert back.last_logits is None


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview], ids=lambda k: k.__name__)
def test_decode_accepts_every_buffer_type(kind):
    chunk = make_chunk(torch.bfloat16, logits=True)
    back = decode(kind(encode(chunk, NS, KEY)), NS, KEY)
    assert_bitwise(back.kv, chunk.kv)
    assert_bitwise(back.last_logits, chunk.last_logits)


def test_round_trip_of_a_non_contiguous_tensor():
    base = torch.randn(2, 2, 8, 3, 4)
    kv = base.transpose(2, 3)  # [2, 2, 3, 8, 4], not contiguous
    assert not kv.is_contiguous()
    back = decode(encode(StoredChunk(kv), NS, KEY), NS, KEY)
    assert back.kv.shape == kv.shape
    assert torch.equal(back.kv, kv)


def test_payload_is_raw_bytes_not_pickle():
    chunk = make_chunk(torch.float32, logits=True)
    data = encode(chunk, NS, KEY)
    header, start = split(data)
    assert data[start:] == bits(chunk.kv).numpy().tobytes() + bits(chunk.last_logits).numpy().tobytes()
    assert b"\x80\x04" not in data[:start]  # no pickle opcode in the header either
    assert header["namespace"] == NS and header["key"] == KEY


def test_round_trip_of_a_single_token_chunk():
    chunk = StoredChunk(torch.randn(1, 2, 1, 1, 4))
    assert_bitwise(decode(encode(chunk, NS, KEY), NS, KEY).kv, chunk.kv)


# -- refusals ----------------------------------------------------------------


@pytest.fixture
def entry():
    """An encoded entry with logits, and the payload offset."""
    data = encode(make_chunk(torch.float32, logits=True), NS, KEY)
    _, start = split(data)
    yield data, start


@pytest.mark.parametrize("bad", [b"", b"KVB", b"XXXX\x00\x00\x00\x00", b"KVB1", b"kvb2"])
def test_bad_magic_is_refused(entry, bad):
    data, _ = entry
    corrupted = bad + data[len(bad) :] if len(bad) == 4 else bad
    with pytest.raises(CorruptEntryError, match="magic"):
        decode(corrupted, NS, KEY)


def test_a_pickle_is_refused():
    import pickle

    with pytest.raises(CorruptEntryError):
        decode(pickle.dumps(make_chunk()), NS, KEY)


def test_every_flipped_payload_byte_is_refused(entry):
    data, start = entry
    # every byte of the KV and the logits, one at a time
    for i in range(start, len(data)):
        corrupted = bytearray(data)
        corrupted[i] ^= 0x01
        with pytest.raises(CorruptEntryError, match="checksum"):
            decode(corrupted, NS, KEY)


CHECKED_FIELDS = ("namespace", "key", "kv_shape", "kv_dtype", "logits_shape", "payload_bytes", "token_ids")


def _field_spans(data: bytes) -> list[tuple[int, int]]:
    """Byte ranges (in ``data``) of the ``"name":value`` text of every field decode must check."""
    header, start = split(data)
    head = data[8:start]
    spans = []
    for name in CHECKED_FIELDS:
        text = f'"{name}":{json.dumps(header[name], separators=(",", ":"))}'.encode()
        at = head.index(text)
        spans.append((8 + at, 8 + at + len(text)))
    return spans


def test_every_flipped_byte_of_magic_length_and_checked_fields_is_refused(entry):
    data, _ = entry
    positions = set(range(8))  # magic and header length
    for lo, hi in _field_spans(data):
        positions.update(range(lo, hi))
    assert len(positions) > 150
    for i in sorted(positions):
        for mask in (0x01, 0x80, 0xFF):
            corrupted = bytearray(data)
            corrupted[i] ^= mask
            with pytest.raises(CorruptEntryError):
                decode(corrupted, NS, KEY)


def test_every_flipped_header_byte_is_refused():
    kwargs = {}
    names = {f.name for f in dataclasses.fields(StoredChunk)}
    if "token_ids" in names:
        kwargs["token_ids"] = tuple(range(5))
    if "parent_key" in names:
        kwargs["parent_key"] = "ab" * 32
    chunk = make_chunk(torch.float32, logits=True)
    data = encode(StoredChunk(chunk.kv, chunk.last_logits, **kwargs), NS, KEY)
    _, start = split(data)
    for i in range(start):  # magic, header length and every byte of the JSON header
        for mask in (0x01, 0x80, 0xFF):
            corrupted = bytearray(data)
            corrupted[i] ^= mask
            with pytest.raises(CorruptEntryError):
                decode(corrupted, NS, KEY)


@pytest.mark.parametrize("cut", [0, 1, 4, 7, 8, 9, "header-1", "header", "payload+1", "-4", "-1"])
def test_truncation_is_refused(entry, cut):
    data, start = entry
    end = len(data)
    length = {"header-1": start - 1, "header": start, "payload+1": start + 1, "-4": end - 4, "-1": end - 1}
    n = length.get(cut, cut)
    assert n < len(data)
    with pytest.raises(CorruptEntryError):
        decode(data[:n], NS, KEY)


def test_trailing_bytes_are_refused(entry):
    data, _ = entry
    with pytest.raises(CorruptEntryError):
        decode(data + b"\x00", NS, KEY)


def test_wrong_namespace_is_refused(entry):
    data, _ = entry
    with pytest.raises(CorruptEntryError, match="namespace"):
        decode(data, "model-b|tok-a|float32|v1", KEY)
    with pytest.raises(CorruptEntryError):
        decode(data, NS + " ", KEY)


def test_wrong_key_is_refused(entry):
    data, _ = entry
    with pytest.raises(CorruptEntryError, match="key"):
        decode(data, NS, "1f" * 32)
    with pytest.raises(CorruptEntryError):
        decode(data, NS, KEY[:-1])


@pytest.mark.parametrize(
    "changes",
    [
        {"kv_shape": [2, 2, 3, 5, 4]},  # fewer bytes than the payload
        {"kv_shape": [2, 2, 3, 10, 8]},  # more
        {"kv_shape": [2, 2, 3, 5, 8, 1]},  # wrong rank
        {"kv_shape": [2, 2, 15, 8]},  # wrong rank, same numel
        {"kv_dtype": "float16"},  # half the bytes
        {"kv_dtype": "int8"},  # not a KV dtype
        {"kv_dtype": "float64"},
        {"logits_shape": None},  # logits bytes left unaccounted for
        {"logits_shape": [18]},
        {"payload_bytes": 10},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_header_claiming_another_shape_or_dtype_is_refused(entry, changes):
    data, _ = entry
    with pytest.raises(CorruptEntryError):
        decode(with_header(data, **changes), NS, KEY)


@pytest.mark.parametrize(
    "dtype, changes",
    [
        (torch.float32, {"kv_shape": [2, 2, 3, 8, 5]}),  # same numel, tokens and head_dim swapped
        (torch.float16, {"kv_dtype": "bfloat16"}),  # same itemsize, other format
    ],
    ids=["same-numel-shape", "same-itemsize-dtype"],
)
def test_header_claiming_a_same_size_shape_or_dtype_is_refused(dtype, changes):
    """A header damaged into another same-size layout is caught: the digest covers the header."""
    data = encode(make_chunk(dtype, logits=True), NS, KEY)
    header, start = split(data)
    header.update(changes)
    head = json.dumps(header, separators=(",", ":")).encode()
    damaged = MAGIC + struct.pack("<I", len(head)) + head + data[start - DIGEST_BYTES :]
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode(damaged, NS, KEY)


@pytest.mark.parametrize(
    "header",
    [b"", b"{}", b"[]", b"null", b"\xff\xfe", b'{"namespace":1}', b"{" * 10],
    ids=["empty", "empty-object", "list", "null", "not-utf8", "partial", "garbage"],
)
def test_unreadable_header_is_refused(entry, header):
    data, start = entry
    corrupted = MAGIC + struct.pack("<I", len(header)) + header + data[start:]
    with pytest.raises(CorruptEntryError):
        decode(corrupted, NS, KEY)


def test_header_length_past_the_end_is_refused(entry):
    data, _ = entry
    corrupted = MAGIC + struct.pack("<I", 2**31) + data[8:]
    with pytest.raises(CorruptEntryError):
        decode(corrupted, NS, KEY)


def test_corrupt_entry_error_is_a_value_error():
    # callers that only know ValueError still catch it
    with pytest.raises(ValueError):
        decode(b"nonsense", NS, KEY)


# -- zero copy ---------------------------------------------------------------


def _inside(t: torch.Tensor, buffer: bytearray) -> bool:
    import ctypes

    base = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    return base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + len(buffer)


def test_decoded_tensors_are_views_on_a_bytearray():
    chunk = make_chunk(torch.bfloat16, logits=True)
    buffer = bytearray(encode(chunk, NS, KEY))
    back = decode(buffer, NS, KEY)
    assert _inside(back.kv, buffer)
    assert _inside(back.last_logits, buffer)
    # and writing the buffer shows through: no copy was made
    _, start = split(bytes(buffer))
    before = back.kv.view(-1)[0].clone()
    buffer[start : start + 2] = bytes(b ^ 0xFF for b in buffer[start : start + 2])
    assert not torch.equal(bits(back.kv.view(-1)[:1]), bits(before.reshape(1)))
    logits_start = start + chunk.kv.nbytes
    buffer[logits_start : logits_start + 4] = struct.pack("<f", 123.5)
    assert back.last_logits[0].item() == 123.5


def test_decoded_tensors_are_views_on_a_writable_memoryview():
    buffer = bytearray(encode(make_chunk(torch.float32), NS, KEY))
    back = decode(memoryview(buffer), NS, KEY)
    assert _inside(back.kv, buffer)


def test_decode_of_read_only_bytes_does_not_alias_it():
    chunk = make_chunk(torch.float32)
    data = encode(chunk, NS, KEY)
    back = decode(data, NS, KEY)
    back.kv.add_(1.0)  # must not write into an immutable bytes object
    assert_bitwise(decode(data, NS, KEY).kv, chunk.kv)


# -- chunk metadata ----------------------------------------------------------


def test_token_ids_and_parent_key_round_trip():
    names = {f.name for f in dataclasses.fields(StoredChunk)}
    if not {"token_ids", "parent_key"} <= names:
        pytest.skip("StoredChunk carries no token_ids / parent_key")
    chunk = make_chunk(torch.float16, shape=(2, 2, 1, 4, 8))
    full = StoredChunk(chunk.kv, None, token_ids=(5, 0, 399, 7), parent_key="cd" * 32)
    back = decode(encode(full, NS, KEY), NS, KEY)
    assert back.token_ids == (5, 0, 399, 7)
    assert back.parent_key == "cd" * 32
    assert_bitwise(back.kv, chunk.kv)
    bare = decode(encode(chunk, NS, KEY), NS, KEY)
    assert bare.token_ids is None and bare.parent_key is None


def test_token_count_that_disagrees_with_the_kv_is_refused():
    names = {f.name for f in dataclasses.fields(StoredChunk)}
    if "token_ids" not in names:
        pytest.skip("StoredChunk carries no token_ids")
    data = encode(make_chunk(torch.float32), NS, KEY)  # 5 tokens
    with pytest.raises(CorruptEntryError):
        decode(with_header(data, token_ids=[1, 2, 3]), NS, KEY)


# -- recompute cost ----------------------------------------------------------------------


def test_the_cost_travels_with_the_entry():
    data = encode(make_chunk(), NS, KEY, cost=42.5)
    entry = decode_entry(data, NS, KEY)
    assert entry.cost == 42.5
    assert_bitwise(entry.chunk.kv, make_chunk().kv)
    assert decode_entry(encode(make_chunk(), NS, KEY), NS, KEY).cost == 1.0  # put's default


def test_an_entry_written_before_costs_has_none():
    import xxhash

    data = encode(make_chunk(), NS, KEY, cost=7.0)
    header, start = split(data)
    del header["cost"]  # as entries were written before costs were stored
    head = json.dumps(header, separators=(",", ":")).encode()
    digest = xxhash.xxh3_128(head + data[start:]).digest()
    legacy = MAGIC + struct.pack("<I", len(head)) + head + digest + data[start:]
    entry = decode_entry(legacy, NS, KEY)
    assert entry.cost is None
    assert_bitwise(entry.chunk.kv, make_chunk().kv)


@pytest.mark.parametrize("cost", [-1.0, "12", True, [1.0]], ids=str)
def test_a_bad_cost_is_refused(cost):
    with pytest.raises(CorruptEntryError, match="cost"):
        decode_entry(with_header(encode(make_chunk(), NS, KEY), cost=cost), NS, KEY)


@pytest.mark.parametrize("value", [None, "text", 1.5, ["list"]], ids=str)
def test_decode_entry_refuses_values_that_are_not_bytes(value):
    with pytest.raises(CorruptEntryError, match="not bytes"):
        decode_entry(value, NS, KEY)


# -- signed entries (a store secret) -------------------------------------------------------------

SECRET = b"a store secret of 32 bytes......"


def forged(data: bytes, kv: torch.Tensor) -> bytes:
    """``data`` with its KV replaced and the digest recomputed, as a writer without the secret would."""
    import xxhash

    (n,) = struct.unpack("<I", data[4:8])
    head, start = data[8 : 8 + n], 8 + n + DIGEST_BYTES + 32
    payload = kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes() + data[start + kv.nbytes :]
    digest = xxhash.xxh3_128(head + payload).digest()
    return data[: 8 + n] + digest + data[8 + n + DIGEST_BYTES : start] + payload


OTHER = b"another secret of 32 bytes......"


@pytest.mark.parametrize("logits", [False, True], ids=["no-logits", "logits"])
def test_a_signed_entry_round_trips_with_its_secret_and_is_foreign_without_one(logits):
    chunk = make_chunk(logits=logits)
    data = encode(chunk, NS, KEY, secret=SECRET)
    assert data[:4] == b"KVS2"
    assert_bitwise(decode(data, NS, KEY, secret=SECRET).kv, chunk.kv)
    with pytest.raises(ForeignEntryError, match="lacks"):
        decode(data, NS, KEY)
    assert_bitwise(decode_entry(data, NS, KEY, check_signature=False).chunk.kv, chunk.kv)  # intact


def test_a_forged_entry_with_a_valid_digest_is_never_served_with_the_secret():
    chunk = make_chunk()
    data = encode(chunk, NS, KEY, secret=SECRET)
    garbage = forged(data, torch.zeros_like(chunk.kv))
    intact = decode_entry(garbage, NS, KEY, check_signature=False).chunk  # the digest holds
    assert torch.equal(intact.kv, torch.zeros_like(chunk.kv))
    with pytest.raises(ForeignEntryError, match="another store secret"):
        decode(garbage, NS, KEY, secret=SECRET)


def test_every_flipped_byte_of_a_signed_entry_is_refused():
    data = encode(make_chunk(shape=(1, 2, 1, 2, 4)), NS, KEY, secret=SECRET)
    (n,) = struct.unpack("<I", data[4:8])
    signature = range(8 + n + DIGEST_BYTES, 8 + n + DIGEST_BYTES + 32)  # not covered by the digest
    for i in range(len(data)):
        corrupted = bytearray(data)
        corrupted[i] ^= 0x01
        with pytest.raises(ForeignEntryError if i in signature else CorruptEntryError):
            decode(corrupted, NS, KEY, secret=SECRET)


def test_an_unsigned_entry_or_another_secret_is_foreign():
    chunk = make_chunk()
    with pytest.raises(ForeignEntryError, match="unsigned"):
        decode(encode(chunk, NS, KEY), NS, KEY, secret=SECRET)
    with pytest.raises(ForeignEntryError, match="another store secret"):
        decode(encode(chunk, NS, KEY, secret=OTHER), NS, KEY, secret=SECRET)


def test_during_a_rotation_every_listed_secret_verifies_and_the_first_signs():
    chunk = make_chunk()
    old, new = encode(chunk, NS, KEY, secret=SECRET), encode(chunk, NS, KEY, secret=[OTHER, SECRET])
    for data in (old, new):
        assert_bitwise(decode(data, NS, KEY, secret=[OTHER, SECRET]).kv, chunk.kv)
    assert_bitwise(decode(new, NS, KEY, secret=OTHER).kv, chunk.kv)
    with pytest.raises(ForeignEntryError):
        decode(old, NS, KEY, secret=OTHER)


def test_a_short_secret_is_refused_with_the_fix():
    from kvboost_rag.config import check_secret

    with pytest.raises(ValueError, match="at least 16"):
        check_secret(b"short")
    assert check_secret(SECRET) == SECRET
