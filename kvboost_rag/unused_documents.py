"""Pre-warmed documents that a request computed again instead of reading: counted and explained.

A user who pre-warms documents expects them read; a prompt shape can leave them unread (exact
mode reads a document only right after the text it was pre-warmed after), and so can eviction.
Each request counts such tokens (``usage.unused_prewarmed_tokens``) from the anchor windows
recorded for pre-warmed documents, without reading the store (well under a millisecond), and the
engine says once per reuse mode why it happens and what to do about it.
"""

from __future__ import annotations

import logging
import threading

import torch

from .blend_match import ANCHOR_TOKENS, Lookup, matchable_tokens, recorded_windows
from .canonical import CanonicalPrompt
from .registry import DocumentRegistry

logger = logging.getLogger(__name__)

ADVICE = {
    "exact": (
        "exact reuse reads a pre-warmed document only right after the text it was pre-warmed after (the "
        "prompt template's opening); documents after the first one, or after text that changes per query "
        "(a question placed first), are computed again. Pass reuse='blend' to reuse them wherever they "
        "stand (approximate), or pre-warm with the template the queries use"
    ),
    "blend": (
        "their stored KV was evicted or removed since they were pre-warmed: pre-warm them again, or give "
        "the store more room (max_memory_bytes, max_disk_bytes)"
    ),
}
"""Why pre-warmed documents go unused, per reuse mode, and what to do about it."""


def unused_document_tokens(
    prompt: CanonicalPrompt,
    begin: int,
    used: torch.Tensor | None,
    *,
    registry: DocumentRegistry,
    namespace: str,
    lookup: Lookup | None = None,
) -> int:
    """About how many prompt tokens from ``begin`` on lie in pre-warmed documents but were computed
    again (``used``: per token, whether its KV came from the store; None: nothing after ``begin``
    did), from the anchor windows recorded for them (:func:`~.blend_match.recorded_windows`; with
    ``used``, the windows alone: the separators between used documents are not theirs). ``lookup``:
    the registry's, as a search of the same request already asked it (:func:`~.blend_match.remembered`)."""
    if len(prompt) - begin < ANCHOR_TOKENS or not registry.may_have_sources():
        return 0
    mask = recorded_windows(
        prompt.token_ids,
        matchable_tokens(prompt),
        begin,
        len(prompt),
        namespace=namespace,
        lookup=lookup or registry.sources,
        fill_gaps=used is None,
    )
    if used is not None:
        mask &= ~used.numpy()
    return int(mask.sum())


class UnusedDocuments:
    """Warns once per reuse mode that prompts left pre-warmed documents unread, and why."""

    def __init__(self) -> None:
        self._told: set[str] = set()
        self._lock = threading.Lock()

    def tell(self, mode: str, tokens: int) -> None:
        if not tokens:
            return
        with self._lock:
            if mode in self._told:
                return
            self._told.add(mode)
        logger.warning(
            "about %d prompt tokens lie in pre-warmed documents but were computed again (reported in "
            "usage.unused_prewarmed_tokens; this warning is given once): %s",
            tokens,
            ADVICE.get(mode, ADVICE["blend"]),
        )
