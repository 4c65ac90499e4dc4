"""Runner: canonical-schedule prefill and token-by-token decode.

Prefill walks the prompt chunk by chunk. A chunk found in the store is laid
into the cache as stored; a missing one is run through the model over the
cache built so far and then stored. The cold and warm paths therefore perform
the same forward calls on the same inputs, and produce the same bits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .assembler import Assembler
from .keys import Chunk
from .sampling import SamplingParams, select_token
from .store.base import KVStore, StoredChunk
from .store.writer import prefill_in_progress

ATTENTION_COST_SPAN = 2048
"""Positions after which a token's attention costs about as much as its MLP (for the eviction cost)."""


@dataclass
class PrefillOutcome:
    cache: Cache
    logits: torch.Tensor | None
    """float32 ``[vocab]`` at the last prompt position (None when not asked for)."""
    cached_by_tier: Counter[str]
    recomputed_tokens: int
    stored_tokens: int
    approx_tokens: int = 0
    """Tokens whose KV was reused approximately (blend mode)."""
    select_s: float = 0.0
    """Seconds spent choosing which reused tokens to recompute (blend mode)."""


def holding_writes(assembler: Assembler) -> AbstractContextManager[None]:
    """Background store writes wait while a CPU prefill runs (they would stall its threads)."""
    return prefill_in_progress() if assembler.device.type == "cpu" else nullcontext()


def recompute_cost(chunk: Chunk) -> float:
    """Work to recompute a chunk, in token units: its tokens, plus attention over everything before."""
    return chunk.num_tokens * (1.0 + chunk.start / ATTENTION_COST_SPAN)


def prefill(
    assembler: Assembler,
    token_ids: Sequence[int],
    chunks: Sequence[Chunk],
    *,
    store: KVStore | None,
    capacity: int,
    store_last_logits: bool = True,
    reusable: bool = True,
    need_logits: bool = True,
) -> PrefillOutcome:
    """Fill a cache with ``token_ids`` over the canonical schedule ``chunks``.

    ``need_logits=False`` (a prefix that more tokens will follow) skips the LM head, and a
    stored last chunk is used even when it kept no logits.
    """
    cache = assembler.new_cache(capacity, reusable=reusable)
    cached: Counter[str] = Counter()
    recomputed = stored = 0
    logits: torch.Tensor | None = None
    last = len(chunks) - 1
    with holding_writes(assembler):
        for i, chunk in enumerate(chunks):
            hit = store.get(chunk.key) if store is not None else None
            if hit is not None and (i < last or not need_logits or hit.chunk.last_logits is not None):
                assembler.append(cache, hit.chunk.kv)
                cached[hit.tier] += chunk.num_tokens
                logits = hit.chunk.last_logits
                continue
            logits = compute_chunk(
                assembler, cache, token_ids, chunks, i,
                store=store, need_logits=need_logits and i == last, store_logits=store_last_logits and i == last,
            )
            recomputed += chunk.num_tokens
            stored += chunk.num_tokens if store is not None else 0
    assert logits is not None or not need_logits  # chunks is never empty: the canonicalizer refuses empty prompts
    return PrefillOutcome(cache, logits, cached, recomputed, stored)


def compute_chunk(
    assembler: Assembler,
    cache: Cache,
    token_ids: Sequence[int],
    chunks: Sequence[Chunk],
    i: int,
    *,
    store: KVStore | None,
    need_logits: bool,
    store_logits: bool,
) -> torch.Tensor | None:
    """Run chunk ``i`` over ``cache`` (which holds everything before it) and store its KV under its prefix key."""
    chunk = chunks[i]
    logits = assembler.forward(cache, list(token_ids[chunk.start : chunk.end]), chunk.start, logits=need_logits)
    if store is not None:
        entry = StoredChunk(
            assembler.extract(cache, chunk.start, chunk.end),
            logits.clone() if store_logits and logits is not None else None,
            token_ids=tuple(token_ids[chunk.start : chunk.end]),
            parent_key=chunks[i - 1].key if i else None,
        )
        store.put(chunk.key, entry, cost=recompute_cost(chunk))
    return logits


def decode(
    assembler: Assembler,
    cache: Cache,
    first_logits: torch.Tensor,
    position: int,
    params: SamplingParams,
    eos_ids: frozenset[int],
    max_new_tokens: int,
) -> Iterator[int]:
    """Yield sampled tokens until EOS (yielded too) or ``max_new_tokens``; the caller may stop early."""
    generator = params.generator(first_logits.device)
    logits = first_logits
    for step in range(max_new_tokens):
        token = select_token(logits, params, generator)
        yield token
        if token in eos_ids or step == max_new_tokens - 1:
            return
        logits = assembler.forward(cache, [token], position)
        position += 1
