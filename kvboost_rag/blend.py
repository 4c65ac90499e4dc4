"""Blend reuse: pre-warmed documents at any position, with selective recompute (opt-in, approximate).

Exact reuse serves a chunk only after the very prefix it was computed with, so
in a RAG prompt it covers the first retrieved document at best. Blend reuse
also serves document tokens wherever a prompt holds them: every stored document
chunk is recorded under anchor keys of its tokens, and a prompt's runs of tokens
equal to a stored chunk's are found by them (:mod:`.blend_match`), whatever text
the framework pasted around each document and however the prompt's chunks fall:

1. the exact prefix is reused or computed as usual (and stored: it is exact),
   up to the first chunk that holds a found run;
2. from there on, each run's stored KV is laid into the cache with its keys
   re-rotated to the positions it now occupies (:mod:`.rope`);
3. tokens whose KV must be fresh are recomputed in one forward pass over that
   cache: everything that is not a reused run (template glue, the question,
   separators), the first ``boundary_tokens`` of each reused document, and the
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
from .blend_match import Run, anchor_keys, find_runs, matchable_tokens, remembered
from .canonical import CanonicalPrompt
from .keys import Chunk
from .registry import DocumentRegistry, Source
from .rope import RopeShifter
from .runner import CacheFiller, PrefillOutcome
from .store.base import Hit, KVStore
from .unused_documents import unused_document_tokens


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
    first_token: int = 0,
) -> None:
    """Record where the document tokens of ``chunks`` (those from ``first_token`` on) are stored,
    under their anchor keys, so that blend reuse finds them in any prompt (:mod:`.blend_match`)."""
    registry.add_sources(
        {
            key: Source(c.key, c.start)
            for c in chunks
            if c.end > first_token
            for key in anchor_keys(namespace, token_ids[max(c.start, first_token) : c.end])
        }
    )


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
    total = len(token_ids)
    is_doc = content_chunks(prompt, chunks)
    # room for the recomputed tokens' fresh KV
    cache = assembler.new_cache(capacity + total, stop=stop)
    hits: dict[str, Hit | None] = {}

    def stored_tokens(key: str) -> Sequence[int] | None:
        if key not in hits:
            hits[key] = store.get(key)
        hit = hits[key]
        return None if hit is None else hit.chunk.token_ids

    lookup = remembered(registry.sources)  # the search and the unused count ask the same keys
    # Runs of stored document tokens, the last token left out: its logits are computed.
    runs = [
        run
        for run in find_runs(
            token_ids,
            matchable_tokens(prompt),
            0,
            total - 1,
            namespace=namespace,
            lookup=lookup,
            stored_tokens=stored_tokens,
        )
        if shifter.can_move(run.source.start + run.offset + run.end - run.start, run.end)
    ]

    def record(first: int, end: int) -> None:  # computed passages are exact: blend may find them later
        documents = [
            c for c, doc in zip(chunks[first : end + 1], is_doc[first : end + 1], strict=True) if doc
        ]
        record_sources(registry, namespace, token_ids, documents)

    def holds_run(i: int) -> bool:
        chunk = chunks[i]
        return any(run.start < chunk.end and chunk.start < run.end for run in runs)

    # 1. The exact prefix: hits, and misses before the first found run, computed and stored.
    filler = CacheFiller(assembler, token_ids, chunks, cache, store, step_tokens=None, on_computed=record)
    logits, first_blend = filler.fill(store_last_logits=store_last_logits, until=holds_run)
    cached, recomputed, stored = filler.cached, filler.recomputed, filler.stored
    if first_blend is None:
        assert logits is not None
        unused = unused_document_tokens(
            prompt, sum(cached.values()), None, registry=registry, namespace=namespace, lookup=lookup
        )
        return PrefillOutcome(
            cache, logits, cached, recomputed, stored, filler.approx, unused_document_tokens=unused
        )

    # 2. From there on: the runs' KV (re-rotated), and the tokens to recompute: everything else,
    # the boundary of each reused document, and the most deviating reused tokens.
    start = chunks[first_blend].start
    kept = _runs_from(runs, start)
    reused = [(run.start, run.end, _moved(run, hits, shifter)) for run in kept]  # kv at its new place
    is_reused = torch.zeros(total, dtype=torch.bool)
    for run in kept:
        is_reused[run.start : run.end] = True
    fresh = ~is_reused  # tokens to recompute
    fresh[:start] = False
    for i, run in enumerate(kept):
        if i == 0 or not _continues(kept[i - 1], run):  # a reused document begins here
            fresh[run.start : run.start + settings.boundary_tokens] = True

    t_select = time.perf_counter()
    budget = math.ceil(settings.recompute_ratio * int(is_reused.sum()))
    if budget:
        _select_deviating(assembler, cache, token_ids, start, reused, fresh, budget, settings.select_layer)
    select_s = time.perf_counter() - t_select

    # Lay the reused KV (placeholders elsewhere), then recompute the fresh tokens over it.
    if reused:
        template = reused[0][2]
        laid = template.new_zeros(*template.shape[:3], total - start, template.shape[4])
        for run_start, run_end, kv in reused:
            laid[:, :, :, run_start - start : run_end - start] = kv
        assembler.append(cache, laid)  # [layers, 2, kv_heads, total - start, dim]
    logits = _recompute(assembler, cache, token_ids, fresh)
    approx = int((is_reused & ~fresh).sum()) + filler.approx
    n_fresh = int(fresh.sum())
    unused = unused_document_tokens(
        prompt, start, is_reused, registry=registry, namespace=namespace, lookup=lookup
    )
    return PrefillOutcome(
        cache,
        logits,
        cached,
        recomputed + n_fresh,
        stored,
        approx_tokens=approx,
        select_s=select_s,
        blended_tokens=int(is_reused.sum()),
        unused_document_tokens=unused,
    )


def _runs_from(runs: Sequence[Run], start: int) -> list[Run]:
    """The runs, or their parts, from prompt position ``start`` on (before it lies the exact prefix)."""
    return [
        Run(max(run.start, start), run.end, run.source, run.offset + max(start - run.start, 0))
        for run in runs
        if run.end > start
    ]


def _continues(before: Run, run: Run) -> bool:
    """Whether ``run`` goes on where ``before`` ends, in the prompt and in the forward that stored them
    (the next chunk of the same document)."""
    stored_end = before.source.start + before.offset + before.end - before.start
    return before.end == run.start and stored_end == run.source.start + run.offset


def _moved(run: Run, hits: dict[str, Hit | None], shifter: RopeShifter) -> torch.Tensor:
    """The run's stored KV ``[layers, 2, kv_heads, end - start, dim]``, keys moved to where it now stands."""
    hit = hits[run.source.prefix_key]
    assert hit is not None  # found runs were confirmed against their stored chunk
    kv = hit.chunk.kv[:, :, :, run.offset : run.offset + run.end - run.start]
    return shifter.move(kv, run.source.start + run.offset, run.start)


def _select_deviating(
    assembler: Assembler,
    cache: Cache,
    token_ids: Sequence[int],
    start: int,
    reused: Sequence[tuple[int, int, torch.Tensor]],
    fresh: torch.Tensor,
    budget: int,
    layer: int,
) -> None:
    """Mark for recompute (in ``fresh``) the ``budget`` reused tokens whose KV at ``layer`` deviates most
    from what the layers below compute over this prompt (``cache`` holds the exact prefix up to ``start``)."""
    true_k, true_v = assembler.probe(cache, token_ids[start:], start, layer)  # [kv_heads, tokens, dim]
    deviation = torch.full((len(token_ids),), -1.0)
    for run_start, run_end, kv_all in reused:
        kv = kv_all[layer].float()  # [2, kv_heads, tokens, dim]
        k_true = true_k[:, run_start - start : run_end - start].float()
        v_true = true_v[:, run_start - start : run_end - start].float()
        deviation[run_start:run_end] = (
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
    logits = assembler.forward_masked(cache, ids, device_positions, mask)
    assembler.settle(cache, device_positions[0])
    return logits
