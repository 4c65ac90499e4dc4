"""Warm-up: store a prompt's KV without generating (system prompts, documents, chat replies)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .assembler.buffered_cache import BufferedCache
from .blend import record_sources
from .canonical import CanonicalPrompt, PromptInput, Segment, normalize_text, segments_before
from .core import EngineCore
from .errors import ContextWindowExceededError, InvalidRequestError
from .held_context import common_prefix
from .keys import salted
from .results import PrewarmReport, WarmReport
from .runner import CacheFiller

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

logger = logging.getLogger(__name__)


def warm(
    core: EngineCore, prompt: PromptInput, *, add_generation_prompt: bool = False, salt: str | None = None
) -> WarmReport:
    """Prefill ``prompt`` into the store, under the tenant ``salt`` (see :meth:`KVBoostEngine.warm`)."""
    t0 = time.perf_counter()
    canonical = core.canonicalize(prompt, add_generation_prompt=add_generation_prompt)
    core.check_window(len(canonical), 0)
    with core.lock:
        out = core.prefill(
            canonical.token_ids, core.chunks(canonical, salt), store=core.store, capacity=len(canonical)
        )
    return WarmReport(
        len(canonical), sum(out.cached_by_tier.values()), out.stored_tokens, time.perf_counter() - t0
    )


def prewarm(
    core: EngineCore,
    documents: Iterable[str],
    *,
    prefix: str | Sequence[Segment],
    pin: bool,
    progress: Callable[[int], None] | None,
    salt: str | None = None,
) -> PrewarmReport:
    """Store and register each document after ``prefix`` (see :meth:`KVBoostEngine.prewarm`)."""
    head = [Segment(prefix, "text")] if isinstance(prefix, str) else list(prefix)
    if not isinstance(prefix, str) and (not head or head[-1].kind != "message"):
        head.append(Segment("", "document"))  # the document is a segment of its own
    t0 = time.perf_counter()
    report = PrewarmReport(documents=0, skipped=0, tokens=0, computed_tokens=0, seconds=0.0)
    store = core.store
    with core.lock:
        for doc in documents:
            doc = normalize_text(doc)
            if not doc:
                continue
            *before, last = head
            canonical = core.canonicalize(
                [*before, Segment(last.text + doc, last.kind)], add_generation_prompt=False
            )
            core.check_window(len(canonical), 0)
            chunks = core.chunks(canonical, salt)
            report.documents += 1
            report.tokens += len(canonical)
            report.keys.append(chunks[-1].key)
            if all(store.contains(c.key) for c in chunks):
                report.skipped += 1
            else:
                out = core.prefill(canonical.token_ids, chunks, store=store, capacity=len(canonical))
                report.computed_tokens += out.recomputed_tokens
            # where blend reuse finds this document's tokens, whatever precedes it at query time
            record_sources(
                core.registry,
                salted(core.namespace, salt),
                canonical.token_ids,
                chunks,
                first_token=token_at(core, canonical, len(canonical.text) - len(doc)),
            )
            if pin:
                for chunk in chunks:
                    store.pin(chunk.key)
            core.registry.register([doc])
            if progress is not None:
                progress(len(canonical))
        store.flush()
    report.seconds = time.perf_counter() - t0
    return report


def store_reply(
    core: EngineCore, messages: Sequence[Mapping[str, Any]], reply: str, salt: str | None = None
) -> WarmReport | None:
    """Store ``messages`` and the assistant ``reply`` as the next turn renders them (see
    :meth:`KVBoostEngine.store_reply`); None when there is nothing reusable to store."""
    head = reply_head(core, messages, reply)
    if head is None:
        return None
    try:
        return warm(core, head, salt=salt)
    except ContextWindowExceededError:
        return None


def store_reply_from_cache(
    core: EngineCore,
    messages: Sequence[Mapping[str, Any]],
    reply: str,
    salt: str | None,
    cache: Cache,
    cache_ids: Sequence[int],
) -> bool:
    """Store the chunks of ``messages`` + ``reply`` (as the next turn renders them) that ``cache``
    holds already: a request's own cache, whose ``cache_ids`` (prompt and fed reply tokens) have
    the KV a prefill gives them. True when that covers the reply's text, so no re-prefill is
    needed (the template's closing tokens after it are left to the next turn's prefill, which
    runs anyway); False when the template renders the reply otherwise than the tokens fed (a stop
    string cut it, a tool call is rendered as JSON, the reply ended at ``max_new_tokens`` and its
    last token was never fed, ...), after storing the chunks before the first difference."""
    head = reply_head(core, messages, reply)
    if head is None:
        return True  # nothing reusable to store
    canonical = core.canonicalize(head, add_generation_prompt=False)
    ids = canonical.token_ids
    common = common_prefix(ids, cache_ids)  # leading tokens the cache holds
    chunks = core.chunks(canonical, salt)
    filler = CacheFiller(core.assembler, ids, chunks, cache, core.store, None, index=core.prefix_index)
    held_from = cache.held_from if isinstance(cache, BufferedCache) else 0
    for i, chunk in enumerate(chunks):
        if chunk.end > common:
            break
        if not core.store.contains(chunk.key):
            if chunk.start < held_from:  # a sliding layer dropped it: the re-prefill stores it
                return False
            filler.put(i, core.assembler.extract(cache, chunk.start, chunk.end), None)
    reply_end = max(
        (
            end
            for segment, (_, end) in zip(canonical.segments, canonical.segment_spans, strict=True)
            if segment.kind == "message"
        ),
        default=len(ids),
    )
    return common >= reply_end


def reply_head(core: EngineCore, messages: Sequence[Mapping[str, Any]], reply: str) -> list[Segment] | None:
    """The segments of ``messages`` and the assistant ``reply`` as the next turn renders them, up to
    the end of the reply; None when nothing of it is reusable (the template cannot render it, or
    it lies beyond a sliding window)."""
    marker = f"\x02reply-end-{uuid.uuid4().hex}\x03"
    following = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": marker}]
    try:
        head = segments_before(core.canonicalizer.segments_of(following, add_generation_prompt=False), marker)
    except InvalidRequestError as e:  # a template that cannot render this: nothing to store
        logger.debug("reply not stored for the next turn: %s", e)
        return None
    while head and (head[-1].kind == "glue" or not head[-1].text):
        head.pop()  # the next message's opening belongs to the next turn's chunks
    if not head:
        return None
    canonical = core.canonicalize(head, add_generation_prompt=False)
    if core.assembler.exact_reuse_blocker(len(canonical) + 1) is not None:
        return None  # beyond a sliding window: nothing of it could be reused
    return head


def token_at(core: EngineCore, prompt: CanonicalPrompt, char_offset: int) -> int:
    """The first token of ``prompt`` that lies wholly at ``char_offset`` of its text or after."""
    position = 0
    for ids, (start, _), segment in zip(
        prompt.segment_token_ids, prompt.segment_spans, prompt.segments, strict=True
    ):
        if position + len(segment.text) <= char_offset:
            position += len(segment.text)
            continue
        wanted = char_offset - position  # characters of this segment before the offset
        lo, hi = 0, len(ids)  # the fewest leading tokens whose text covers them (text grows with tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(core.canonicalizer.decode(ids[:mid])) >= wanted:
                hi = mid
            else:
                lo = mid + 1
        return start + lo
    return len(prompt)
