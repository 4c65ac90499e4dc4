"""Runner: prefill from the store (decoding is :mod:`.decoding`).

Prefill walks the prompt's chunks. Stored chunks are laid into the cache as
stored; each run of missing chunks is run through the model over the cache
built so far, then stored. Two schedules keep this exact (DESIGN.md contract 2):

- *split-invariant* (``assembler.invariant``): every forward gives each token
  the bits of one forward over the whole prompt, so a run of missing chunks is
  one call (at most ``step_tokens`` tokens a call) and any stored prefix is
  reusable, chunk by (small) chunk;
- *canonical* (the fallback): one forward per chunk, the same calls whatever is
  stored, so the cold and warm paths perform the same operations.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache

from .assembler import Assembler
from .assembler.buffered_cache import BufferedCache
from .busy import prefill_in_progress
from .held_context import TIER as HELD_TIER
from .keys import Chunk
from .prefix_index import PrefixIndex
from .store.base import Hit, KVStore, StoredChunk

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
    """Tokens whose KV was reused approximately (blend mode, or read from a lossy store codec)."""
    select_s: float = 0.0
    """Seconds spent choosing which reused tokens to recompute (blend mode)."""
    blended_tokens: int = 0
    """Tokens whose stored KV blend mode laid at a new position (``approx_tokens`` of them kept it)."""
    unused_document_tokens: int = 0
    """About how many tokens of pre-warmed documents were computed again instead of read."""


def holding_writes(assembler: Assembler) -> AbstractContextManager[None]:
    """Background store writes wait while a CPU prefill runs (they would stall its threads)."""
    return prefill_in_progress() if assembler.device.type == "cpu" else nullcontext()


def recompute_cost(chunk: Chunk) -> float:
    """Work to recompute a chunk, in token units: its tokens, plus attention over everything before."""
    return chunk.num_tokens * (1.0 + chunk.start / ATTENTION_COST_SPAN)


class CacheFiller:
    """Fills one cache along a prompt's chunks, counting what came from where.

    ``on_computed(first, last)`` is called after chunks ``first..last`` were computed and stored.
    With an ``index`` (split-invariant mode), the first chunk that misses by key lays the leading
    tokens it shares with a chunk stored after the same prefix (:mod:`.prefix_index`), and only
    the rest is computed; every chunk stored or read is added to the index.
    """

    def __init__(
        self,
        assembler: Assembler,
        token_ids: Sequence[int],
        chunks: Sequence[Chunk],
        cache: Cache,
        store: KVStore | None,
        step_tokens: int | None,
        on_computed: Callable[[int, int], None] | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        self.assembler, self.token_ids, self.chunks, self.cache = assembler, token_ids, chunks, cache
        self.store, self.step_tokens, self.on_computed = store, step_tokens, on_computed
        self.index = index if assembler.invariant else None
        self.cached: Counter[str] = Counter()
        """Tokens laid exactly from each tier."""
        self.recomputed = self.stored = 0
        self.approx = 0
        """Tokens laid from entries of a lossy codec (approximate reuse, never counted as cached)."""

    def fill(
        self,
        *,
        need_logits: bool = True,
        store_last_logits: bool = True,
        until: Callable[[int], bool] | None = None,
        held_tokens: int = 0,
    ) -> tuple[torch.Tensor | None, int | None]:
        """Lay each run of stored chunks, compute each run of missing ones; the last token's logits.

        ``until(i)``, asked of each chunk that is not laid from the store, ends the walk before
        chunk ``i`` when true; the second value is then ``i`` (else None). ``held_tokens``: the
        cache holds the prompt's first tokens already (a held context), fewer than all of them.
        """
        assert until is None or not held_tokens
        chunks, store, assembler = self.chunks, self.store, self.assembler
        last = len(chunks) - 1
        logits: torch.Tensor | None = None
        hits: list[Hit] = []  # stored chunks not laid yet
        missing: int | None = None  # first chunk of a run not computed yet
        laid = 0  # leading tokens of chunk ``missing`` laid from a chunk that shares them
        stopped_at: int | None = None
        begin, partial = self._resume(held_tokens)
        for i in range(begin, len(chunks)):
            chunk = chunks[i]
            if i == begin and partial:  # its leading tokens are in the cache: the rest is computed
                missing, laid = i, partial
                continue
            hit = store.get(chunk.key) if store is not None else None
            if hit is not None:
                self._learn(chunk, hit.chunk)
            final = i == last and need_logits
            if hit is not None and (not final or hit.chunk.last_logits is not None):
                if missing is not None:
                    self.compute(missing, i - 1, logits=False, store_logits=False, laid=laid)
                    missing = None
                hits.append(hit)
                logits = hit.chunk.last_logits
                continue
            if hit is not None and assembler.invariant and missing is None:
                self.lay(hits)
                hits = []
                logits = self.finish_stored(hit, store_last_logits)
                continue
            if until is not None and until(i):
                stopped_at, last, need_logits = i, i - 1, False
                break
            if missing is None:
                missing, laid = i, self.lay_with_shared(hits, i, final)
                hits = []
        self.lay(hits)
        if missing is not None:
            logits = self.compute(
                missing, last, logits=need_logits, store_logits=store_last_logits and need_logits, laid=laid
            )
        assert (
            logits is not None or not need_logits
        )  # chunks is never empty: the canonicalizer refuses empty prompts
        return logits, stopped_at

    def _resume(self, held_tokens: int) -> tuple[int, int]:
        """The first chunk to walk when the cache holds the prompt's first ``held_tokens`` already,
        and how many leading tokens of it stay in the cache. A stored chunk is laid whole instead
        (it may keep the prompt's last logits, and laying it costs less than computing the rest)."""
        if not held_tokens:
            return 0, 0
        begin = next(i for i, c in enumerate(self.chunks) if c.end > held_tokens)
        chunk = self.chunks[begin]
        partial = held_tokens - chunk.start
        if partial and self.store is not None and self.store.contains(chunk.key):
            assert isinstance(self.cache, BufferedCache)  # held contexts are buffered caches
            self.cache.truncate(chunk.start)
            partial = 0
        self.cached[HELD_TIER] += chunk.start + partial
        return begin, partial

    def lay_with_shared(self, hits: Sequence[Hit], i: int, final: bool) -> int:
        """Lay ``hits``, then the leading tokens that chunk ``i`` (missing by key) shares with a chunk
        stored after the same prefix; returns how many tokens of chunk ``i`` that laid. ``final``:
        chunk ``i`` ends the prompt and its last token's logits are wanted (it is left to compute)."""
        shared = self._shared_hit(i, final)
        if shared is None:
            self.lay(hits)
            return 0
        hit, tokens = shared
        self.lay([*hits, hit], tokens)
        return tokens

    def _shared_hit(self, i: int, final: bool) -> tuple[Hit, int] | None:
        if self.index is None or self.store is None:
            return None
        chunk = self.chunks[i]
        wanted = self.token_ids[chunk.start : chunk.end]
        found = self.index.longest_prefix(chunk.parent, wanted)
        if found is None:
            return None
        key, shared = found
        tokens = min(shared, chunk.num_tokens - 1) if final else shared
        if tokens <= 0:
            return None
        hit = self.store.get(key)
        stored_ids = hit.chunk.token_ids if hit is not None else None
        if hit is None or stored_ids is None or tuple(stored_ids[:tokens]) != tuple(wanted[:tokens]):
            self.index.discard(chunk.parent, key)  # evicted since (or rewritten): not to be trusted
            return None
        return hit, tokens

    def _learn(self, chunk: Chunk, stored: StoredChunk) -> None:
        if self.index is not None and stored.token_ids is not None:
            self.index.add(chunk.parent, chunk.key, stored.token_ids)

    def finish_stored(self, hit: Hit, store_logits: bool) -> torch.Tensor:
        """Lay the prompt's stored last chunk, which kept no logits (it was stored as a prefix), and run
        its last token again for them: in split-invariant mode that gives the bits of a cold prefill."""
        chunk = self.chunks[-1]
        self.lay([hit], chunk.num_tokens - 1)
        logits = self.assembler.forward(self.cache, self.token_ids[chunk.end - 1 : chunk.end], chunk.end - 1)
        assert logits is not None
        self.recomputed += 1
        if self.store is not None and store_logits:
            entry = replace(hit.chunk, last_logits=logits.clone())  # approximate KV stays labelled so
            self.store.put(chunk.key, entry, cost=recompute_cost(chunk))
        return logits

    def lay(self, hits: Sequence[Hit], tokens: int | None = None) -> None:
        """Append stored chunks (of the last one only its first ``tokens`` when given)."""
        if not hits:
            return
        kvs = [h.chunk.kv for h in hits]
        if tokens is not None:
            kvs[-1] = kvs[-1][:, :, :, :tokens]
        self.assembler.append(self.cache, kvs)
        for hit, kv in zip(hits, kvs, strict=True):
            if hit.chunk.approximate:
                self.approx += kv.shape[3]
            else:
                self.cached[hit.tier] += kv.shape[3]

    def compute(
        self, first: int, last: int, *, logits: bool, store_logits: bool, laid: int = 0
    ) -> torch.Tensor | None:
        """Run chunks ``first..last`` (inclusive) over the cache and store them; logits of the last token.
        ``laid``: leading tokens of chunk ``first`` in the cache already (split-invariant mode)."""
        chunks = self.chunks[first : last + 1]
        begin = chunks[0].start + laid
        if self.assembler.invariant:
            spans = _steps(begin, chunks[-1].end, self.step_tokens)
        else:  # the canonical schedule: one forward per chunk
            assert not laid  # tokens are shared within a chunk only in split-invariant mode
            spans = [(c.start, c.end) for c in chunks]
        out = None
        for start, end in spans:
            out = self.assembler.forward(
                self.cache, self.token_ids[start:end], start, logits=logits and end == chunks[-1].end
            )
        self.recomputed += chunks[-1].end - begin
        if self.store is not None:
            for i in range(first, last + 1):
                keep = out.clone() if store_logits and i == last and out is not None else None
                self.put(
                    i, self.assembler.extract(self.cache, self.chunks[i].start, self.chunks[i].end), keep
                )
        if self.on_computed is not None:
            self.on_computed(first, last)
        return out

    def put(self, i: int, kv: torch.Tensor, logits: torch.Tensor | None) -> None:
        chunk = self.chunks[i]
        entry = StoredChunk(
            kv,
            logits,
            token_ids=tuple(self.token_ids[chunk.start : chunk.end]),
            parent_key=self.chunks[i - 1].key if i else None,
        )
        assert self.store is not None
        self.store.put(chunk.key, entry, cost=recompute_cost(chunk))
        self._learn(chunk, entry)
        self.stored += chunk.num_tokens


def _steps(start: int, end: int, step_tokens: int | None) -> list[tuple[int, int]]:
    """``start..end`` cut into calls of at most ``step_tokens`` tokens."""
    step = step_tokens or end - start
    return [(s, min(s + step, end)) for s in range(start, end, step)]


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
    step_tokens: int | None = None,
    stop: threading.Event | None = None,
    index: PrefixIndex | None = None,
    held: tuple[BufferedCache, int] | None = None,
) -> PrefillOutcome:
    """Fill a cache with ``token_ids`` along ``chunks``, reading what ``store`` holds and storing the rest.

    ``need_logits=False`` (a prefix that more tokens will follow) skips the LM head, and a
    stored last chunk is used even when it kept no logits. ``step_tokens`` caps the tokens
    of one forward in split-invariant mode (memory), at no cost to exactness. Once ``stop``
    is set, the prefill raises ``CancelledError`` at its next layer; what it stored stays valid.
    With an ``index``, a chunk that misses by key reuses the tokens it shares with a stored one
    (see :class:`CacheFiller`). ``held``: a cache that holds the first tokens of ``token_ids``
    already, and how many (a held context, :mod:`.held_context`); the prefill goes on from it.
    """
    held_tokens = 0
    cache: Cache
    if held is not None:
        held[0].stop_on(stop)
        cache, held_tokens = held
    else:
        cache = assembler.new_cache(capacity, reusable=reusable, stop=stop)
    filler = CacheFiller(assembler, token_ids, chunks, cache, store, step_tokens, index=index)
    with holding_writes(assembler):
        logits, _ = filler.fill(
            need_logits=need_logits, store_last_logits=store_last_logits, held_tokens=held_tokens
        )
    return PrefillOutcome(cache, logits, filler.cached, filler.recomputed, filler.stored, filler.approx)
