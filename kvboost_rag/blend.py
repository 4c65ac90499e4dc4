"""Blend reuse: pre-warmed documents at any position, with selective recompute (opt-in, approximate).

Exact reuse serves a chunk only after the very prefix it was computed with, so
in a RAG prompt it covers the first retrieved document at best. Blend reuse
also serves a content chunk found under its *content key* (its tokens alone).
Text is cut at paragraph breaks (:func:`~kvboost_rag.canonical.split_paragraphs`),
so a passage has the same chunks wherever it follows a break:

1. the exact prefix is reused or computed as usual (and stored: it is exact);
2. from the first chunk that is found only by content, each such chunk's
   stored KV is laid into the cache with its keys re-rotated to the positions
   it now occupies (:mod:`.rope`);
3. tokens whose KV must be fresh are recomputed in one forward pass over that
   cache: everything that is not a reused document (template glue, the
   question), the first ``boundary_tokens`` of each reused document, and the
   ``recompute_ratio`` of reused tokens whose KV deviates most, at
   ``select_layer``, from what full attention over this prompt gives
   (CacheBlend's selection). Each recomputed token attends to the reused KV of
   the tokens before it and to the fresh KV of recomputed ones.

Approximate KV is never stored: a prefix key always names exact KV.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .assembler import Assembler
from .canonical import CanonicalPrompt
from .keys import Chunk, content_key, group_spans
from .registry import DocumentRegistry, Source
from .rope import RopeShifter
from .runner import CacheFiller, PrefillOutcome
from .store.base import KVStore


@dataclass(frozen=True)
class BlendSettings:
    recompute_ratio: float
    """Share of reused document tokens recomputed, chosen by KV deviation at ``select_layer``."""
    boundary_tokens: int
    """Leading tokens of each reused document that are always recomputed."""
    select_layer: int
    """Layer whose KV deviation ranks the reused tokens (running the layers below it costs the selection)."""


def content_chunks(prompt: CanonicalPrompt, chunks: Sequence[Chunk]) -> list[bool]:
    """Per chunk: whether it holds content only (no template glue), so may be a reused passage."""
    spans = [
        span
        for seg, span in zip(prompt.segments, prompt.segment_spans, strict=True)
        if seg.kind in ("glue", "closing")
    ]
    return [not any(s < c.end and c.start < e for s, e in spans) for c in chunks]


def record_sources(
    registry: DocumentRegistry,
    namespace: str,
    token_ids: Sequence[int],
    chunks: Sequence[Chunk],
    flags: Sequence[bool],
) -> None:
    """Record where each document chunk (``flags``) is stored, so blend reuse can find it by content."""
    registry.add_sources(
        {
            content_key(namespace, token_ids[c.start : c.end]): Source(c.key, c.start)
            for c, is_doc in zip(chunks, flags, strict=True)
            if is_doc
        }
    )


def _reusable_kv(
    chunk: Chunk,
    token_ids: Sequence[int],
    *,
    store: KVStore,
    registry: DocumentRegistry,
    namespace: str,
    shifter: RopeShifter,
) -> torch.Tensor | None:
    """Stored KV of this chunk's tokens, re-rotated to the chunk's positions, or None."""
    tokens = tuple(token_ids[chunk.start : chunk.end])
    source = registry.source(content_key(namespace, tokens))
    if source is None or not shifter.can_move(source.start + len(tokens), chunk.end):
        return None
    hit = store.get(source.prefix_key)
    if hit is None or hit.chunk.token_ids != tokens:  # evicted, or overwritten by another document
        return None
    return shifter.move(hit.chunk.kv, source.start, chunk.start)


def blend_prefill(
    assembler: Assembler,
    shifter: RopeShifter,
    prompt: CanonicalPrompt,
    chunks: Sequence[Chunk],
    *,
    store: KVStore,
    registry: DocumentRegistry,
    namespace: str,
    settings: BlendSettings,
    capacity: int,
    store_last_logits: bool = True,
    stop: threading.Event | None = None,
) -> PrefillOutcome:
    """Fill a cache for ``prompt``: exact prefix, then reused documents with selective recompute.

    The caller holds background writes back (:func:`~kvboost_rag.runner.holding_writes`), as for a
    prefill. Once ``stop`` is set, the prefill raises ``CancelledError`` at its next layer.
    """
    token_ids = prompt.token_ids
    is_doc = content_chunks(prompt, chunks)
    last = len(chunks) - 1
    # room for the recomputed tokens' fresh KV
    cache = assembler.new_cache(capacity + len(token_ids), stop=stop)
    reused: dict[int, torch.Tensor] = {}

    def record(first: int, end: int) -> None:  # computed passages are exact: blend may find them later
        record_sources(registry, namespace, token_ids, chunks[first : end + 1], is_doc[first : end + 1])

    def reusable(i: int) -> bool:
        if not is_doc[i] or i == last:
            return False
        kv = _reusable_kv(
            chunks[i], token_ids, store=store, registry=registry, namespace=namespace, shifter=shifter
        )
        if kv is not None:
            reused[i] = kv
        return kv is not None

    # 1. The exact prefix: hits, and misses with no reusable passage, computed and stored.
    filler = CacheFiller(assembler, token_ids, chunks, cache, store, step_tokens=None, on_computed=record)
    logits, first_blend = filler.fill(store_last_logits=store_last_logits, until=reusable)
    cached, recomputed, stored = filler.cached, filler.recomputed, filler.stored
    if first_blend is None:
        assert logits is not None
        return PrefillOutcome(cache, logits, cached, recomputed, stored, filler.approx)

    # 2. From the first reusable document on: reused KV (re-rotated), and the tokens to recompute:
    # everything else, the boundary of each reused document, and the most deviating reused tokens.
    start, total = chunks[first_blend].start, len(token_ids)
    for i in range(first_blend + 1, last):
        reusable(i)
    is_reused = torch.zeros(total, dtype=torch.bool)
    for i in reused:
        is_reused[chunks[i].start : chunks[i].end] = True
    fresh = ~is_reused  # tokens to recompute
    fresh[:start] = False
    for group_start, _ in group_spans(prompt):
        if is_reused[group_start]:  # a reused document begins here
            fresh[group_start : group_start + settings.boundary_tokens] = True

    t_select = time.perf_counter()
    budget = math.ceil(settings.recompute_ratio * int(is_reused.sum()))
    if budget:
        _select_deviating(
            assembler,
            cache,
            token_ids,
            start,
            {chunks[i]: kv for i, kv in reused.items()},
            fresh,
            budget,
            settings.select_layer,
        )
    select_s = time.perf_counter() - t_select

    # Lay the reused KV (placeholders elsewhere), then recompute the fresh tokens over it.
    template = next(iter(reused.values()))
    pieces = [
        reused.get(i, template.new_zeros(*template.shape[:3], chunks[i].num_tokens, template.shape[4]))
        for i in range(first_blend, len(chunks))
    ]
    assembler.append(cache, torch.cat(pieces, dim=3))  # [layers, 2, kv_heads, total - start, dim]
    logits = _recompute(assembler, cache, token_ids, fresh)
    approx = int((is_reused & ~fresh).sum()) + filler.approx
    n_fresh = int(fresh.sum())
    return PrefillOutcome(
        cache, logits, cached, recomputed + n_fresh, stored, approx_tokens=approx, select_s=select_s
    )


def _select_deviating(
    assembler: Assembler,
    cache: Cache,
    token_ids: Sequence[int],
    start: int,
    reused: dict[Chunk, torch.Tensor],
    fresh: torch.Tensor,
    budget: int,
    layer: int,
) -> None:
    """Mark for recompute (in ``fresh``) the ``budget`` reused tokens whose KV at ``layer`` deviates most
    from what the layers below compute over this prompt (``cache`` holds the exact prefix up to ``start``)."""
    true_k, true_v = assembler.probe(cache, token_ids[start:], start, layer)  # [kv_heads, tokens, dim]
    deviation = torch.full((len(token_ids),), -1.0)
    for c, kv_all in reused.items():
        kv = kv_all[layer].float()  # [2, kv_heads, tokens, dim]
        k_true = true_k[:, c.start - start : c.end - start].float()
        v_true = true_v[:, c.start - start : c.end - start].float()
        deviation[c.start : c.end] = (
            ((kv[0] - k_true) ** 2).sum((0, 2)) + ((kv[1] - v_true) ** 2).sum((0, 2))
        ).cpu()
    deviation[fresh] = -1.0  # recomputed anyway
    fresh[deviation.topk(min(budget, int((deviation >= 0).sum()))).indices] = True


def _recompute(
    assembler: Assembler, cache: Cache, token_ids: Sequence[int], fresh: torch.Tensor
) -> torch.Tensor:
    """Run the ``fresh`` tokens over ``cache`` (which holds a slot per prompt token) in one forward, move
    their new KV into their slots, and return the logits of the last one (the prompt's last token)."""
    positions = fresh.nonzero().squeeze(1)  # [q], ascending
    slots = torch.arange(len(token_ids))
    # [q, slots]: reused and exact KV strictly before the query; the stale KV of fresh tokens never
    past = (slots[None, :] < positions[:, None]) & ~fresh[None, :]
    # [q, q]: the new KV of fresh tokens up to and including the query itself
    own = positions[None, :] <= positions[:, None]
    mask = torch.cat((past, own), dim=1)[None, None].to(assembler.device)  # [1, 1, q, slots + q]
    device_positions = positions.to(assembler.device)[None]  # [1, q]
    ids = torch.tensor(token_ids, device=assembler.device)[device_positions]
    logits = assembler.forward_rows(cache, ids, device_positions, mask)[0]
    assembler.settle(cache, device_positions[0])
    return logits
