"""Entry codecs: how a stored chunk's KV tensor becomes payload bytes, named in each entry's header.

- ``raw``: the tensor's bytes as they are (read back as a view, no copy).
- ``zstd`` (lossless): the bytes are split into byte planes (the first byte of every value, then
  the second, ...), which puts the slowly varying sign and exponent bytes side by side, and the
  planes are compressed with Zstandard. Decoding gives the same bits.
- ``int8`` / ``int4`` (approximate): keys are quantized per channel (one scale per channel and
  group of :data:`GROUP` tokens), values per token (one scale per token and group of
  :data:`GROUP` channels), symmetrically to the group's largest magnitude, with float32 scales.
  Keys vary most across channels and values across tokens, so each is scaled along the axis
  where its outliers stay inside one group (as KIVI does). Decoding gives the chunk's dtype back.

A store writes with one codec and reads every one, so a store may hold several.

>>> import torch
>>> kv = torch.randn(2, 2, 3, 70, 64)  # [layers, 2, kv_heads, tokens, head_dim]
>>> zstd = codec_named("zstd")
>>> torch.equal(zstd.decode(b"".join(zstd.encode(kv)), kv.shape, kv.dtype), kv)
True
>>> int8 = codec_named("int8")
>>> payload = b"".join(int8.encode(kv))
>>> back = int8.decode(payload, kv.shape, kv.dtype)
>>> bool((back - kv).abs().max() < 0.05), round(kv.nbytes / len(payload), 2)
(True, 3.68)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

GROUP = 64
"""Values per quantization scale: tokens of one key channel, channels of one value token."""

Payload = bytes | bytearray | memoryview


class Codec(ABC):
    """Turns a KV tensor ``[layers, 2, kv_heads, tokens, head_dim]`` into payload bytes and back."""

    name: str
    approximate: bool
    """Decoding gives other values than were encoded (hits count as approximate reuse)."""

    @abstractmethod
    def encode(self, kv: torch.Tensor) -> list[Payload]:
        """The payload, in parts to be joined."""

    @abstractmethod
    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The KV tensor of ``shape`` and ``dtype``; raises ``ValueError`` where the payload does not fit."""


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (on the CPU, in memory order)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _writable(payload: Payload) -> bytearray | memoryview:
    """``payload`` as a buffer torch can view (it needs a writable one)."""
    if isinstance(payload, bytearray) or (isinstance(payload, memoryview) and not payload.readonly):
        return payload
    return bytearray(payload)


class Raw(Codec):
    name, approximate = "raw", False

    def encode(self, kv: torch.Tensor) -> list[Payload]:
        return [raw_bytes(kv)]

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        count = _numel(shape)
        if len(payload) != count * dtype.itemsize:
            raise ValueError(f"raw payload of {len(payload)} bytes for {count} {dtype} values")
        return torch.frombuffer(_writable(payload), dtype=dtype, count=count).reshape(tuple(shape))


class Zstd(Codec):
    """Byte planes compressed with Zstandard (lossless)."""

    name, approximate = "zstd", False
    LEVEL = 1
    """Zstandard's fastest level: on KV planes higher levels save little and cost much more time."""

    def encode(self, kv: torch.Tensor) -> list[Payload]:
        import zstandard

        planes = kv.detach().to("cpu").contiguous().reshape(-1, 1).view(torch.uint8).t().contiguous()
        return [zstandard.ZstdCompressor(level=self.LEVEL).compress(raw_bytes(planes))]

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        import zstandard

        count, size = _numel(shape), dtype.itemsize
        try:
            planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=count * size)
        except zstandard.ZstdError as e:
            raise ValueError(f"not a zstd frame ({e})") from e
        if len(planes) != count * size:
            raise ValueError(f"zstd payload holds {len(planes)} bytes, not {count * size}")
        flat = torch.frombuffer(bytearray(planes), dtype=torch.uint8).reshape(size, count)
        return _join_planes(flat).view(dtype).reshape(tuple(shape))


_SAME_WIDTH = {2: torch.int16, 4: torch.int32}
"""An integer type of each value width, to put the bytes of a value back together in."""


def _join_planes(planes: torch.Tensor) -> torch.Tensor:
    """Values from their byte planes ``[value bytes, count]`` (plane ``k``: byte ``k`` of each value in
    memory order, the least significant first on a little-endian machine), as integers of that width.

    Shifts and ORs over whole planes, where transposing the planes back gathers byte by byte
    (a 64-token SmolLM2 chunk: 0.09 against 3.9 ms).

    >>> planes = torch.tensor([[0x34, 0xFF], [0x12, 0x80]], dtype=torch.uint8)
    >>> [hex(v & 0xFFFF) for v in _join_planes(planes).tolist()]
    ['0x1234', '0x80ff']
    """
    size = planes.shape[0]
    values = planes[size - 1].to(_SAME_WIDTH[size])
    for k in range(size - 2, -1, -1):
        values.bitwise_left_shift_(8).bitwise_or_(planes[k])  # wraps past the sign bit: same bits
    return values


class Quantized(Codec):
    """Symmetric group-wise quantization to ``bits`` (8 or 4): keys per channel, values per token.

    Payload: keys' codes, values' codes (int8, or two 4-bit codes a byte), then the keys' and
    the values' float32 scales.
    """

    approximate = True

    def __init__(self, bits: int) -> None:
        self.bits, self.name = bits, f"int{bits}"
        self.levels = 2 ** (bits - 1) - 1  # codes -levels..levels

    def _grouped(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[L, H, T/G, G, D]`` (groups of tokens) and values ``[L, H, T, D/G, G]`` (groups of
        channels), zero-padded to whole groups."""
        keys, values = kv[:, 0].float(), kv[:, 1].float()  # [L, H, T, D]
        tokens, dim = keys.shape[2], keys.shape[3]
        pad_t, pad_d = -tokens % GROUP, -dim % GROUP
        keys = torch.nn.functional.pad(keys, (0, 0, 0, pad_t))
        values = torch.nn.functional.pad(values, (0, pad_d))
        layers, heads = keys.shape[:2]
        return (
            keys.reshape(layers, heads, -1, GROUP, dim),
            values.reshape(layers, heads, tokens, -1, GROUP),
        )

    def _codes(self, x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale = x.abs().amax(dim=axis, keepdim=True) / self.levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(x / scale).clamp_(-self.levels, self.levels).to(torch.int8)
        return codes, scale

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        flat = codes.reshape(-1)
        if self.bits == 8:
            return flat
        nibbles = (flat + 8).to(torch.uint8)  # 1..15
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
        return nibbles[0::2] | (nibbles[1::2] << 4)

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        if self.bits == 8:
            return packed.view(torch.int8)
        nibbles = torch.empty(2 * packed.numel(), dtype=torch.uint8)
        torch.bitwise_and(packed, 0x0F, out=nibbles[0::2])
        torch.bitwise_right_shift(packed, 4, out=nibbles[1::2])
        return nibbles[:count].view(torch.int8).sub_(8)  # nibbles are 1..15: as int8, the same bits

    def _code_bytes(self, count: int) -> int:
        return count if self.bits == 8 else (count + 1) // 2

    def _layout(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """Codes (keys', and values' alike) and the keys' and values' scale counts of a KV ``shape``."""
        layers, _, heads, tokens, dim = (int(s) for s in shape)
        codes = layers * heads * tokens * dim
        return codes, layers * heads * -(-tokens // GROUP) * dim, layers * heads * tokens * -(-dim // GROUP)

    def encode(self, kv: torch.Tensor) -> list[Payload]:
        tokens, dim = kv.shape[3], kv.shape[4]
        keys, values = self._grouped(kv)
        key_codes, key_scales = self._codes(keys, axis=3)
        value_codes, value_scales = self._codes(values, axis=4)
        # the codes of real tokens and channels only; the groups' padding is not stored
        key_codes = key_codes.flatten(2, 3)[:, :, :tokens]  # [L, H, T, D]
        value_codes = value_codes.flatten(3, 4)[..., :dim]  # [L, H, T, D]
        parts = (self._pack(key_codes), self._pack(value_codes), key_scales, value_scales)
        return [raw_bytes(p) for p in parts]

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if len(shape) != 5 or int(shape[1]) != 2:
            raise ValueError(f"not a KV shape: {list(shape)}")
        codes, key_scales, value_scales = self._layout(shape)
        code_bytes = self._code_bytes(codes)
        sizes = [code_bytes, code_bytes, 4 * key_scales, 4 * value_scales]
        if len(payload) != sum(sizes):
            raise ValueError(f"{self.name} payload of {len(payload)} bytes, not {sum(sizes)}")
        buffer, offsets = _writable(payload), [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        key_codes, value_codes = (
            self._unpack(torch.frombuffer(buffer, dtype=torch.uint8, count=code_bytes, offset=at), codes)
            for at in offsets[:2]
        )
        k_scale = torch.frombuffer(buffer, dtype=torch.float32, count=key_scales, offset=offsets[2])
        v_scale = torch.frombuffer(buffer, dtype=torch.float32, count=value_scales, offset=offsets[3])
        if not (torch.isfinite(k_scale).all() and torch.isfinite(v_scale).all()):
            raise ValueError("scales that are not finite")
        layers, _, heads, tokens, dim = (int(s) for s in shape)
        out = torch.empty(layers, 2, heads, tokens, dim, dtype=dtype)  # [L, 2, H, T, D]
        key_codes, value_codes = (c.reshape(layers, heads, tokens, dim) for c in (key_codes, value_codes))
        k_scale = k_scale.reshape(layers, heads, -1, dim)  # per channel and group of tokens
        v_scale = v_scale.reshape(layers, heads, tokens, -1)  # per token and group of channels
        _scale_into(out[:, 0], key_codes, k_scale, axis=2)
        _scale_into(out[:, 1], value_codes, v_scale, axis=3)
        return out


def _scale_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, axis: int) -> None:
    """``out = codes * scales``, a scale for each :data:`GROUP` consecutive codes along ``axis`` (the
    last group may be short). One pass: each product is taken in float32 and rounded once, to
    ``out``'s dtype, as ``(codes.float() * scales).to(dtype)`` would."""
    n = codes.shape[axis]
    whole = n // GROUP * GROUP
    if whole:
        torch.mul(
            codes.narrow(axis, 0, whole).unflatten(axis, (-1, GROUP)),
            scales.narrow(axis, 0, whole // GROUP).unsqueeze(axis + 1),
            out=out.narrow(axis, 0, whole).unflatten(axis, (-1, GROUP)),
        )
    if whole < n:
        torch.mul(
            codes.narrow(axis, whole, n - whole),
            scales.narrow(axis, whole // GROUP, 1),
            out=out.narrow(axis, whole, n - whole),
        )


RAW = Raw()
CODECS: dict[str, Codec] = {c.name: c for c in (RAW, Zstd(), Quantized(8), Quantized(4))}
"""Every codec, by the name entries record."""


def codec_named(name: str) -> Codec:
    """The codec called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown store codec {name!r}; known: {', '.join(CODECS)}") from None
