"""Where pre-warmed document tokens stand in a prompt, wherever a framework pasted them (blend reuse).

A prompt's chunks line up with a document's stored chunks only where the document starts a
segment group (after a paragraph break). Frameworks paste documents elsewhere too: after a single
newline, after a separator line, on the line of a label (``"Context: ..."``), and follow the last
one with more text (``"\\n---------------------\\nGiven the context..."``), so its last partial
chunk never lines up. Documents are therefore found by their tokens, not by the prompt's chunks:

- every stored document chunk is recorded under *anchor keys*: the content key of the
  :data:`ANCHOR_TOKENS` tokens at each of its *content-defined* offsets (those whose token
  window hashes to 0 modulo :data:`ANCHOR_SPACING`, so the same tokens give the same offsets
  wherever they stand), and of its first tokens (fewer for a short last chunk);
- a prompt's windows at its own content-defined positions are looked up in one batch; a hit is
  confirmed against the stored chunk's tokens and extended left and right as far as they agree
  (within that chunk): a :class:`Run`;
- a run that reaches its stored chunk's end is continued by looking up the next chunk's first
  tokens right there (a short last chunk may hold no content-defined offset of its own).

Keys never depend on positions, so a run may come from a document computed after another
prefix: blend re-rotates its keys and recomputes a share of it (:mod:`.blend`). Matching is by
equal tokens only; the canonical tokens themselves never depend on what is recorded.

>>> ids = list(range(100, 164))
>>> offsets = anchor_offsets(ids)
>>> bool(all(0 <= o <= len(ids) - ANCHOR_TOKENS for o in offsets))
True
>>> [int(o) - 7 for o in anchor_offsets([0] * 7 + ids)] == [int(o) for o in offsets]  # moved with the tokens
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .canonical import CanonicalPrompt
from .keys import content_key
from .registry import Source

ANCHOR_TOKENS = 8
"""Tokens of one anchor window: long enough that unrelated text rarely shares one."""
ANCHOR_SPACING = 8
"""Mean tokens between content-defined offsets (one anchor key per ~8 tokens recorded and looked up)."""

FILLED_GAP_TOKENS = 3 * ANCHOR_TOKENS
"""Tokens between two recorded windows counted as document text too (content-defined windows
start more than this apart in ~1.4 % of cases)."""

_MIX = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
        0x27D4EB2F165667C5,
        0x94D049BB133111EB,
    ],
    dtype=np.uint64,
)


Lookup = Callable[[list[str]], Mapping[str, Source]]
"""Anchor keys -> where they were recorded (absent: unknown)."""


class Run(NamedTuple):
    """Prompt tokens ``start:end`` equal to the tokens ``offset:offset + (end - start)`` of a stored chunk."""

    start: int
    end: int
    source: Source
    offset: int


def matchable_tokens(prompt: CanonicalPrompt) -> np.ndarray:
    """Per token: whether it may be reused from a document (template glue never is)."""
    out = np.ones(len(prompt), dtype=bool)
    for seg, (start, end) in zip(prompt.segments, prompt.segment_spans, strict=True):
        if seg.kind in ("glue", "closing"):
            out[start:end] = False
    return out


def anchor_offsets(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Content-defined offsets of ``ids``: where the window of :data:`ANCHOR_TOKENS` tokens starting
    there hashes to 0 modulo :data:`ANCHOR_SPACING` (a fixed integer mix, the same in every process)."""
    a = np.asarray(ids, dtype=np.uint64)
    n = len(a) - ANCHOR_TOKENS + 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    h = np.zeros(n, dtype=np.uint64)
    for j in range(ANCHOR_TOKENS):  # wrapping uint64 arithmetic
        h += a[j : j + n] * _MIX[j]
    h ^= h >> np.uint64(31)
    h *= _MIX[0]
    h ^= h >> np.uint64(29)
    return np.flatnonzero(h % np.uint64(ANCHOR_SPACING) == 0)


def anchor_keys(namespace: str, ids: Sequence[int]) -> set[str]:
    """Every anchor key of one stored chunk's tokens (its content-defined windows and its start)."""
    keys = {content_key(namespace, ids[o : o + ANCHOR_TOKENS]) for o in anchor_offsets(ids).tolist()}
    keys.add(content_key(namespace, ids[:ANCHOR_TOKENS]))
    return keys


class _Matcher:
    """Finds the runs of one prompt's tokens that recorded document chunks hold."""

    def __init__(
        self,
        token_ids: Sequence[int],
        matchable: np.ndarray,
        namespace: str,
        lookup: Lookup,
        stored_tokens: Callable[[str], Sequence[int] | None],
    ) -> None:
        self.ids = list(token_ids)
        self.matchable = matchable
        self.namespace = namespace
        self.lookup = lookup
        self.stored_tokens = stored_tokens
        # blocked[i]: unmatchable tokens before i (a window is matchable when none lie in it)
        self.blocked = np.concatenate(([0], np.cumsum(~matchable)))

    def window_ok(self, start: int, end: int) -> bool:
        return bool(self.blocked[end] == self.blocked[start])

    def confirm(self, p: int, width: int, source: Source, lo: int, hi: int, *, at_start: bool) -> Run | None:
        """The longest run through prompt tokens ``p:p + width`` that the stored chunk holds, kept
        within ``lo:hi``; ``at_start``: the window must be the chunk's first tokens."""
        stored = self.stored_tokens(source.prefix_key)
        if stored is None:
            return None
        ids, ok = self.ids, self.matchable
        window = ids[p : p + width]
        offsets = [0] if at_start else range(len(stored) - width + 1)
        best: Run | None = None
        for o in offsets:
            if list(stored[o : o + width]) != window:
                continue
            left = 0
            while (
                o - left > 0
                and p - left > lo
                and ok[p - left - 1]
                and stored[o - left - 1] == ids[p - left - 1]
            ):
                left += 1
            right = width
            while (
                o + right < len(stored)
                and p + right < hi
                and ok[p + right]
                and stored[o + right] == ids[p + right]
            ):
                right += 1
            if best is None or right + left > best.end - best.start:
                best = Run(p - left, p + right, source, o - left)
        return best

    def reaches_end(self, run: Run) -> bool:
        stored = self.stored_tokens(run.source.prefix_key)
        return stored is not None and run.offset + run.end - run.start == len(stored)

    def hits(self, begin: int, end: int) -> list[tuple[int, Source]]:
        """The content-defined windows of ``begin:end`` that are recorded (one batch lookup), in order."""
        positions = [
            begin + int(o)
            for o in anchor_offsets(self.ids[begin:end])
            if self.window_ok(begin + int(o), begin + int(o) + ANCHOR_TOKENS)
        ]
        keys = {p: content_key(self.namespace, self.ids[p : p + ANCHOR_TOKENS]) for p in positions}
        found = self.lookup(sorted(set(keys.values()))) if keys else {}
        return [(p, found[keys[p]]) for p in positions if keys[p] in found]

    def by_anchors(self, begin: int, end: int) -> list[Run]:
        """Runs found from the content-defined windows of ``begin:end``: every hit extended as far as
        its stored chunk agrees, then the longest kept first (:func:`_packed`)."""
        candidates: list[Run] = []
        for p, source in self.hits(begin, end):
            if any(
                run.source == source and run.start <= p and p + ANCHOR_TOKENS <= run.end for run in candidates
            ):
                continue  # inside a run of the same chunk found already
            run = self.confirm(p, ANCHOR_TOKENS, source, begin, end, at_start=False)
            if run is not None:
                candidates.append(run)
        return _packed(candidates)

    def continued(self, runs: list[Run], end: int) -> list[Run]:
        """``runs`` with the chunks that follow them: after a run that ends its stored chunk, the
        next chunk's first tokens (a short last chunk included) are looked up where it ends."""
        tried: set[int] = set()
        while True:
            gaps = []  # (position, next run's start) after each run that ends its stored chunk
            for i, run in enumerate(runs):
                bound = runs[i + 1].start if i + 1 < len(runs) else end
                if run.end < bound and run.end not in tried and self.reaches_end(run):
                    gaps.append((run.end, bound))
                    tried.add(run.end)
            keys = {
                (p, w): content_key(self.namespace, self.ids[p : p + w])
                for p, bound in gaps
                for w in range(1, min(ANCHOR_TOKENS, bound - p) + 1)
                if self.window_ok(p, p + w)
            }
            found = self.lookup(sorted(set(keys.values()))) if keys else {}
            new = []
            for p, bound in gaps:
                for w in range(min(ANCHOR_TOKENS, bound - p), 0, -1):
                    source = found.get(keys.get((p, w), ""))
                    following = (
                        None if source is None else self.confirm(p, w, source, p, bound, at_start=True)
                    )
                    if following is not None:
                        new.append(following)
                        break
            if not new:
                return runs
            runs = sorted([*runs, *new])


def _packed(candidates: Sequence[Run]) -> list[Run]:
    """Non-overlapping runs, in order: the longest candidates first, each shorter one cut to the
    tokens still free (a piece of a run is a run). A window that two texts share by chance yields a
    short candidate; the document it belongs to yields a long one, which wins."""
    taken: set[int] = set()
    out = []
    for run in sorted(candidates, key=lambda r: (r.start - r.end, r.start)):
        position = run.start
        while position < run.end:
            while position < run.end and position in taken:
                position += 1
            piece_end = position
            while piece_end < run.end and piece_end not in taken:
                piece_end += 1
            if piece_end > position:
                out.append(Run(position, piece_end, run.source, run.offset + position - run.start))
                taken.update(range(position, piece_end))
            position = piece_end
    return sorted(out)


def remembered(lookup: Lookup) -> Lookup:
    """``lookup`` asked each key once: one request's searches share its answers, absent keys included."""
    known: dict[str, Source | None] = {}

    def ask(keys: list[str]) -> dict[str, Source]:
        missing = [k for k in keys if k not in known]
        if missing:
            found = lookup(missing)
            known.update({k: found.get(k) for k in missing})
        return {k: s for k in keys if (s := known[k]) is not None}

    return ask


def find_runs(
    token_ids: Sequence[int],
    matchable: np.ndarray,
    begin: int,
    end: int,
    *,
    namespace: str,
    lookup: Lookup,
    stored_tokens: Callable[[str], Sequence[int] | None],
) -> list[Run]:
    """Non-overlapping runs of ``token_ids[begin:end]`` held by recorded document chunks, in order.

    ``matchable[i]``: whether token i may be reused (template glue never is); ``lookup`` maps
    anchor keys to where they were recorded (absent: unknown); ``stored_tokens`` gives a stored
    chunk's tokens by its prefix key (None: gone from the store).
    """
    if end - begin <= 0:
        return []
    matcher = _Matcher(token_ids, matchable, namespace, lookup, stored_tokens)
    return matcher.continued(matcher.by_anchors(begin, end), end)


def recorded_windows(
    token_ids: Sequence[int],
    matchable: np.ndarray,
    begin: int,
    end: int,
    *,
    namespace: str,
    lookup: Lookup,
    fill_gaps: bool = True,
) -> np.ndarray:
    """Per token of ``token_ids``: whether it lies in ``begin:end`` within pre-warmed document text,
    as the recorded anchor windows there show (no stored chunk is read): hit windows, and (with
    ``fill_gaps``) the gaps of at most :data:`FILLED_GAP_TOKENS` between two of them, which may
    hold a short separator between two documents. An estimate, for telling a user that
    documents went unused; :func:`find_runs` is the exact search."""
    mask = np.zeros(len(token_ids), dtype=bool)
    last_end = None
    for p, _ in _Matcher(token_ids, matchable, namespace, lookup, lambda _: None).hits(begin, end):
        if fill_gaps and last_end is not None and 0 <= p - last_end <= FILLED_GAP_TOKENS:
            mask[last_end:p] = True
        mask[p : p + ANCHOR_TOKENS] = True
        last_end = p + ANCHOR_TOKENS
    return mask
