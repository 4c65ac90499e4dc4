"""Engine configuration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_serializer, model_validator

DEFAULT_INVARIANT_CHUNK = 64
"""Chunk size with the split-invariant forward: reuse to within 64 tokens of any shared prefix."""
DEFAULT_CANONICAL_CHUNK = 1024
"""Chunk size of the canonical schedule, where each chunk is also a forward step."""

ReuseMode = Literal["exact", "blend", "off"]
PrefillSchedule = Literal["auto", "invariant", "canonical"]
StoreCodec = Literal["raw", "zstd", "int8", "int4"]

REDACTED = "***"

MIN_SECRET_BYTES = 16


def check_secret(secret: bytes) -> bytes:
    """``secret`` if it is long enough to sign store entries; else ValueError naming the fix.

    >>> check_secret(b"short")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the store secret has 5 bytes; use at least 16 random bytes ...
    """
    if len(secret) < MIN_SECRET_BYTES:
        msg = (
            f"the store secret has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
            "(python -c 'import secrets; print(secrets.token_hex(32))')"
        )
        raise ValueError(msg)
    return secret


def redacted_url(url: str | None) -> str | None:
    """``url`` with its password (if any) replaced, for dumps and logs.

    >>> redacted_url("redis://:s3cret@cache.local:6379/0")
    'redis://:***@cache.local:6379/0'
    >>> redacted_url("redis://cache.local:6379/0")
    'redis://cache.local:6379/0'
    """
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{REDACTED}@{host}"))


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every password-like value replaced (nested mappings too).

    >>> redacted_options({"password": "s3cret", "client_options": {"username": "u", "password": "p"}})
    {'password': '***', 'client_options': {'username': 'u', 'password': '***'}}
    """
    out: dict[str, Any] = {}
    for name, value in options.items():
        if "password" in name.lower() and value is not None:
            out[name] = REDACTED
        elif isinstance(value, Mapping):
            out[name] = redacted_options(value)
        else:
            out[name] = value
    return out


class EngineConfig(BaseModel):
    """Knobs of a :class:`~kvboost_rag.KVBoostEngine`.

    >>> EngineConfig(chunk_size=128).chunk_size
    128
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk_size: int | None = Field(default=None, ge=1, le=65536)
    """Most tokens in one stored chunk: the granularity of exact reuse (``None``: 64 with the
    split-invariant forward, 1024 with the canonical schedule).

    With the split-invariant forward (see ``prefill_schedule``) a prompt sharing a stored prefix
    reuses it to within one chunk, whatever the chunk size, and the missing part runs as one call;
    smaller chunks cost more store entries. With the canonical schedule every chunk is also a
    prefill step, which re-reads all weights: on a 2-core CPU (SmolLM2, 1-2K tokens) 512-token
    steps measured ~0.87x the speed of one full prefill, 1024-token steps 0.97-1.0x. Chunks never
    cross a segment, so documents and messages keep their own chunks either way."""

    prefill_schedule: PrefillSchedule = "auto"
    """``auto``: probe at load (once per model and platform, remembered) whether forwards split at
    any point give the bits of one forward, and use the split-invariant forward if so, else the
    canonical chunk schedule (``engine.stats()["reuse"]`` and ``result.reuse_note`` say which).
    ``invariant``: the same, but an unsupported platform raises. ``canonical``: always chunk by chunk."""

    max_forward_tokens: int = Field(default=8192, ge=8)
    """Most tokens in one forward call of the split-invariant prefill (bounds activation memory);
    longer runs of missing chunks take several calls, with the same bits."""

    store_replies: bool = True
    """After a chat request (messages), store its reply as the chat template renders it in the
    next turn, so the next turn reuses it: from the request's own cache as the answer returns
    (decode steps have a prefill's bits), or, where the template renders the reply otherwise than
    the tokens generated (or the reply was decoded in a batch), by a re-prefill in the background
    once no request has been in progress for a moment. ``engine.flush()`` waits for that work
    (before timing the model directly, say)."""

    max_memory_bytes: int = Field(default=2 * 1024**3, ge=0)
    """Byte budget of the memory tier; least valuable chunks are evicted beyond it."""

    max_disk_bytes: int | None = Field(default=None, ge=0)
    """Byte budget of the disk tier (``None``: unbounded); unpinned chunks are evicted beyond it."""

    store_secret: SecretStr | None = Field(default=None, repr=False)
    """Signs every disk and Redis entry this engine writes (HMAC-SHA256), and only entries signed
    with it are read: a process that can write the store (or the Redis server) but lacks the
    secret cannot make this engine serve its KV. At least 16 bytes (checked when the store
    opens, so no error shows it); every process that shares the store needs the same one.
    Entries signed otherwise, or not at all, are *foreign*: misses for this engine, counted
    (``engine.stats()["disk"]["extra"]["foreign"]``) and logged once, but left in the store for the
    processes that wrote them (``kvboost-rag gc --foreign`` removes them). The CLI reads it
    from ``KVBOOST_STORE_SECRET`` or ``--store-secret-file``. Costs a hash of every byte read
    (~1.5 GB/s with SHA-NI). Never in dumps or reprs."""

    store_previous_secrets: list[SecretStr] = Field(default_factory=list, repr=False)
    """Secrets entries may also be signed with, read but never written: a pool moving from one
    secret to another lists the old one here while ``store_secret`` holds the new one, so every
    entry stays readable until the old ones age out (see the README's Security section). Needs
    ``store_secret``. The CLI reads them from ``KVBOOST_STORE_PREVIOUS_SECRETS`` (comma-separated)
    or ``--store-previous-secret-file`` (one per line)."""

    store_codec: StoreCodec = "raw"
    """How the disk and Redis tiers write KV (``kvboost_rag.store.codecs``); every codec is read
    back, so a store may hold several. ``"zstd"``: lossless (byte planes + Zstandard), exact mode
    stays bitwise. ``"int8"`` / ``"int4"``: approximate (keys per channel, values per token), about
    3.8x / 7x fewer bytes than float32; their hits count as ``usage.approx_tokens``, never as
    exact, and a store configured with an exact codec never serves them (they are misses)."""

    store_file_mode: int | None = Field(default=0o600, ge=0, le=0o777)
    """Permission bits of the files the disk tier creates (directories get the matching search
    bits: 0o600 -> 0o700). 0o640 or 0o660 lets a group share the store; None leaves it to the umask."""

    redis_url: str | None = Field(default=None, repr=False)
    """Shared remote tier after memory and disk: ``redis://[:password@]host:port/db`` (``rediss://``
    for TLS), read by every worker process; ``None``: off. A failing Redis only costs misses."""

    redis_key_prefix: str = "kvboost"
    """First part of every Redis key (``{prefix}:{namespace}:{key}``); separates deployments on one server."""

    redis_ttl_s: float | None = Field(default=None, gt=0)
    """Expiry of Redis entries, renewed whenever one is read (``None``: none); pinned ones never expire."""

    max_redis_bytes: int | None = Field(default=None, ge=0)
    """Byte budget of this model's entries in Redis (``None``: the server's own limits); the least
    recently used unpinned ones are evicted beyond it."""

    redis_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """More :class:`~kvboost_rag.store.redis.RedisStore` arguments: ``password``, ``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``client_options``, ``connect_timeout_s``, ``timeout_s``,
    ``cluster`` (a Redis Cluster), ..."""

    reuse: ReuseMode = "exact"
    """``exact``: reuse chunks under their prefix key (zero loss). ``blend``: also reuse pre-warmed
    documents wherever they appear (approximate, reported as ``usage.approx_tokens``; RoPE models
    only). ``off``: never read or write the store."""

    blend_recompute_ratio: float = Field(default=0.05, ge=0.0, le=1.0)
    """Blend mode: share of reused document tokens recomputed, those whose KV deviates most.

    ``benchmarks/blend_quality.py`` (2-core CPU, 3-6 essay passages, exact mode prefilling at plain
    speed): at 0.05 TTFT is 4.2x (Qwen2.5-0.5B) and 3.5x (SmolLM2-135M) faster than exact mode, at
    0.15 3.0x / 2.7x, at 0.30 2.1x / 1.9x. Qwen2.5-0.5B agreed with exact mode on every question at
    every ratio; SmolLM2-135M, far more sensitive, agreed on 90 % at 0.05, 87 % at 0.15 and 93 % at
    0.30 (and with itself on 93 % when only the order of the passages changed), so 0.15 buys
    nothing over 0.05 there."""

    blend_boundary_tokens: int = Field(default=8, ge=0)
    """Blend mode: leading tokens of each reused document that are always recomputed."""

    blend_select_layer: int = Field(default=1, ge=0)
    """Blend mode: the layer whose KV deviation picks the tokens to recompute; the layers
    below it run over the new tokens to find out (the selection's cost)."""

    max_batch_size: int = Field(default=32, ge=1, le=1024)
    """Most concurrent :meth:`~kvboost_rag.KVBoostEngine.generate` calls served as one batch; 1 runs every
    request alone (in a batch, float rounding may differ from a lone run; see ``generate_batch``)."""

    batch_transposed_weights: bool = True
    """On CPU, batched steps multiply by a transposed copy of each linear weight, which BLAS
    runs several times faster for a few rows (an 8-row SmolLM2 decode step: 113 ms against
    151 ms), and one-row decode steps (the canonical schedule) do so for the LM head (a tenth of
    a SmolLM2 step); costs one extra copy of the weights (made at first use). Prefills and the
    split-invariant decode steps of lone requests never use them. False: no copy."""

    max_draft_tokens: int = Field(default=7, ge=0, le=63)
    """Speculative decoding from the prompt: most tokens drafted per decode step by looking up the
    sequence's last tokens in the prompt and the reply so far (answers quote their documents),
    verified by the model in one forward; 0 turns it off. The output is the same either way
    (greedy: tokens and logits bitwise; seeded sampling: the same tokens). Up to 7 drafts ride in
    the rows that a split-invariant decode step pads for its matrix products anyway (only their
    attention costs a little); drafting pauses after three verifications in a row confirmed
    nothing, and more than 7 are drafted only after drafts were confirmed whole twice in a row
    (a step of 16 rows costs ~1.3x one of 8 on a 2-core CPU). Lone requests only, with the
    split-invariant forward."""

    stream_buffer_deltas: int = Field(default=4096, ge=1)
    """Most undelivered text deltas a stream may hold while its reader falls behind; past it the
    stream is stopped with :class:`~kvboost_rag.errors.StreamOverflowError`. Streams share the
    batches' decode steps, which never wait for a reader."""

    batch_window_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)
    """How long a request waits for others to join its batch. 0: no wait; requests still batch
    when they arrive while another batch runs. A lone request pays at most this much latency."""

    store_last_logits: bool = True
    """Keep the final-position logits with the last chunk of each prompt, so that a repeated
    prompt needs no forward pass at all before its first token."""

    held_context_tokens: int = Field(default=8192, ge=0)
    """Most tokens of the last exact requests' caches kept in memory (newest first), so that a
    request that continues one (the next turn of a chat or an agent loop, a prompt extended by a
    few words, a new question after the same documents) goes on from it, as llama.cpp goes on from
    its context: what it shares is not laid from the store again, only what follows is computed,
    with the same bits. Counted in ``usage.cached_tokens_by_tier["context"]``; 0 keeps none. About
    23 KiB a token for SmolLM2-135M in bfloat16, on top of ``max_memory_bytes``."""

    @property
    def store_secrets_bytes(self) -> tuple[bytes, ...]:
        """Every secret the tiers verify with, the one they sign with first (none: unsigned)."""
        if self.store_secret is None:
            return ()
        return tuple(s.get_secret_value().encode() for s in (self.store_secret, *self.store_previous_secrets))

    @model_validator(mode="after")
    def _previous_secrets_need_a_secret(self) -> EngineConfig:
        if self.store_previous_secrets and self.store_secret is None:
            msg = (
                "store_previous_secrets are read only next to a store_secret that signs; set store_secret "
                "(KVBOOST_STORE_SECRET) to the new secret and list the old ones as previous"
            )
            raise ValueError(msg)
        return self

    @field_serializer("redis_url")
    def _dump_redis_url(self, url: str | None) -> str | None:
        return redacted_url(url)  # dumps and logs never carry the password; the engine reads the field

    @field_serializer("redis_options")
    def _dump_redis_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return redacted_options(options)

    def chunk_tokens(self, *, invariant: bool) -> int:
        """``chunk_size``, or its default for the prefill schedule in use.

        >>> EngineConfig().chunk_tokens(invariant=True), EngineConfig().chunk_tokens(invariant=False)
        (64, 1024)
        """
        if self.chunk_size is not None:
            return self.chunk_size
        return DEFAULT_INVARIANT_CHUNK if invariant else DEFAULT_CANONICAL_CHUNK
