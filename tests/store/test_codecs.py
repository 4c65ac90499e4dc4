"""Store codecs: lossless ones give the bits back, lossy ones stay within their quantization step, and
entries record their codec, so a store holding several reads each one right."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import xxhash
import zstandard

from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.codecs import CODECS, GROUP, codec_named
from kvboost_rag.store.disk import DiskStore
from kvboost_rag.store.serialization import MAGIC, CorruptEntryError, decode, decode_entry, encode

NS, KEY = "model-a|tok-a|float32|v1", "0f" * 32
SHAPES = [(2, 2, 3, 70, 64), (1, 2, 2, 1, 48), (3, 2, 1, 128, 80)]
"""[layers, 2, kv_heads, tokens, head_dim]: token and channel counts on and off whole groups."""


def kv(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.linspace(0.1, 8, shape[-1])).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = codec_named(name)
    return codec.decode(b"".join(codec.encode(x)), x.shape, x.dtype)


@pytest.mark.parametrize("name", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_lossless_codecs_give_every_bit_back(name, dtype, shape):
    x = kv(shape, dtype)
    x.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")], dtype=dtype)
    back = round_trip(name, x)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(bits(back), bits(x))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_codecs_stay_within_half_a_step_of_each_group(name, shape):
    x = kv(shape)
    back = round_trip(name, x)
    assert back.shape == x.shape and back.dtype == x.dtype
    levels = 127 if name == "int8" else 7
    keys, values = x[:, 0], x[:, 1]  # [L, H, T, D]
    # keys: one scale per channel and group of tokens; values: per token and group of channels
    key_max = torch.cat(
        [
            keys[:, :, t : t + GROUP].abs().amax(2, keepdim=True).expand_as(keys[:, :, t : t + GROUP])
            for t in range(0, keys.shape[2], GROUP)
        ],
        dim=2,
    )
    value_max = torch.cat(
        [
            values[..., c : c + GROUP].abs().amax(3, keepdim=True).expand_as(values[..., c : c + GROUP])
            for c in range(0, values.shape[3], GROUP)
        ],
        dim=3,
    )
    tolerance = 0.5 / levels + 1e-6
    assert ((back[:, 0] - keys).abs() <= key_max * tolerance).all()
    assert ((back[:, 1] - values).abs() <= value_max * tolerance).all()


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_codecs_give_the_float32_products_rounded_to_the_dtype_asked(name, dtype, shape):
    codec = codec_named(name)
    payload = b"".join(codec.encode(kv(shape)))
    products = codec.decode(payload, shape, torch.float32)  # code x scale, taken in float32
    assert torch.equal(bits(codec.decode(payload, shape, dtype)), bits(products.to(dtype)))


def test_an_all_zero_group_comes_back_as_zeros():
    x = torch.zeros(1, 2, 1, 3, 64)
    assert torch.equal(round_trip("int4", x), x) and torch.equal(round_trip("int8", x), x)


@pytest.mark.parametrize(("name", "at_least"), [("int8", 3.5), ("int4", 6.5)])
def test_quantized_entries_are_several_times_smaller_than_float32(name, at_least):
    chunk = StoredChunk(kv((30, 2, 3, 64, 64)))  # SmolLM2-135M's layout, one 64-token chunk
    ratio = len(encode(chunk, NS, KEY)) / len(encode(chunk, NS, KEY, codec=codec_named(name)))
    assert ratio >= at_least


@pytest.mark.parametrize("name", list(CODECS))
def test_every_codec_round_trips_through_an_entry_and_says_whether_it_is_exact(name):
    chunk = StoredChunk(kv(SHAPES[0]), torch.randn(11), (1, 2) * 35, "parent")
    back = decode(encode(chunk, NS, KEY, codec=codec_named(name)), NS, KEY)
    assert back.codec == name and back.approximate == codec_named(name).approximate
    assert torch.equal(back.last_logits, chunk.last_logits)  # logits are always raw
    assert back.token_ids == chunk.token_ids and back.parent_key == "parent"
    if not back.approximate:
        assert torch.equal(back.kv, chunk.kv)


def _reframed(data: bytes, header_change: dict | None = None, payload: bytes | None = None) -> bytes:
    """``data`` with its header fields changed or its payload replaced, and a digest that matches:
    what only a bug or a crafted value could hold."""
    (head_len,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8 : 8 + head_len])
    start = 8 + head_len + 16
    body = payload if payload is not None else data[start:]
    header.update(header_change or {})
    header["payload_bytes"] = len(body)
    head = json.dumps(header).encode()
    digest = xxhash.xxh3_128(head + body).digest()
    return MAGIC + struct.pack("<I", len(head)) + head + digest + body


@pytest.mark.parametrize("name", ["zstd", "int8", "int4"])
def test_corrupt_compressed_payloads_are_refused(name):
    data = bytearray(encode(StoredChunk(kv(SHAPES[0])), NS, KEY, codec=codec_named(name)))
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode_entry(flipped, NS, KEY)
    (head_len,) = struct.unpack("<I", data[4:8])
    body = bytes(data[8 + head_len + 16 :])
    garbage = b"\xff" * len(body)  # the right length, nothing a codec wrote (NaN scales, no frame)
    with pytest.raises(CorruptEntryError, match=f"undecodable {name} payload"):
        decode_entry(_reframed(bytes(data), payload=garbage), NS, KEY)
    with pytest.raises(CorruptEntryError, match="truncated or malformed"):
        decode_entry(_reframed(bytes(data), payload=body[:-7]), NS, KEY)


def test_an_entry_naming_an_unknown_codec_is_refused():
    data = encode(StoredChunk(kv(SHAPES[1])), NS, KEY)
    with pytest.raises(CorruptEntryError, match="unknown store codec 'zip'"):
        decode_entry(_reframed(data, {"codec": "zip"}), NS, KEY)


def test_an_unknown_codec_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown store codec 'int2'; known: raw, zstd, int8, int4"):
        codec_named("int2")


def test_a_store_mixing_codecs_reads_each_entry_right(tmp_path):
    chunks = {name: StoredChunk(kv(SHAPES[0], seed=i)) for i, name in enumerate(CODECS)}
    for name, chunk in chunks.items():  # each entry written by a store configured for its codec
        store = DiskStore(tmp_path, NS, background_writes=False, codec=name)
        store.put(name, chunk)
        store.close()

    lossy = DiskStore(tmp_path, NS, background_writes=False, codec="int8")
    for name, chunk in chunks.items():
        hit = lossy.get(name)
        assert hit is not None and hit.chunk.codec == name
        assert torch.equal(hit.chunk.kv, round_trip(name, chunk.kv))  # the entry's own codec decoded it
    lossy.close()

    exact = DiskStore(tmp_path, NS, background_writes=False, codec="zstd")
    assert exact.get("int8") is None and exact.get("int4") is None  # never served as exact
    assert exact.contains("int8")  # a miss, not a corrupt entry: it stays for the stores that want it
    assert torch.equal(exact.get("raw").chunk.kv, chunks["raw"].kv)
    assert exact.stats()["disk"].extra["corrupt"] == 0
    exact.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zstd_reads_the_byte_plane_layout_it_has_always_written(dtype):
    """The stored format: plane k holds byte k of every value in memory order, compressed whole."""
    x = kv((2, 2, 3, 70, 64), dtype)
    planes = x.reshape(-1).view(torch.uint8).reshape(-1, dtype.itemsize).t().contiguous()
    payload = zstandard.ZstdCompressor(level=3).compress(planes.numpy().tobytes())
    assert torch.equal(bits(codec_named("zstd").decode(payload, x.shape, dtype)), bits(x))
