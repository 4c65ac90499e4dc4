"""Held contexts: the caches of the last exact requests, kept for the requests that continue them.

When an exact request ends, its cache holds the KV of its prompt and of the reply tokens it fed,
with the bits a prefill gives them (the split-invariant forward; DESIGN.md contract 2). The next
request that starts with the same tokens, in the same namespace and for the same tenant, goes on
from that cache, as llama.cpp goes on from its context: what it shares is not laid from the
store again, and only what follows is computed. The store holds the same chunks either way; a
held context saves the copy (28-36 ms for a 4K-token SmolLM2 prompt) and the store's lookups.

A held cache is handed to one request at a time (:meth:`HeldContexts.take` removes it), so two
requests never write into the same buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .assembler.buffered_cache import BufferedCache

TIER = "context"
"""The name under which tokens read from a held context are counted (``usage.cached_tokens_by_tier``)."""


@dataclass
class _Held:
    namespace: str
    token_ids: tuple[int, ...]
    cache: BufferedCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):  # the usual case (a continuation), compared in one C call
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


class HeldContexts:
    """The caches of the most recent exact requests, up to ``max_tokens`` tokens in all.

    >>> held = HeldContexts(max_tokens=0)  # nothing is held
    >>> held.stats()["held_tokens"]
    0
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._held: list[_Held] = []  # oldest first
        self._lock = threading.Lock()
        self.reads = 0
        """Requests that went on from a held context."""
        self.read_tokens = 0
        """Tokens those requests did not lay from the store."""

    def keep(self, namespace: str, token_ids: Sequence[int], cache: BufferedCache) -> None:
        """Hold ``cache``, whose first ``len(token_ids)`` positions hold ``token_ids`` with a prefill's
        bits, for a request that continues them; the oldest held caches go beyond ``max_tokens``.

        A cache whose sliding-window layers dropped positions is not held: a request that shares
        fewer tokens would attend to keys it no longer has."""
        tokens = len(token_ids)
        if not 0 < tokens <= self.max_tokens or cache.held_from > 0 or cache.get_seq_length() < tokens:
            return
        cache.truncate(tokens)
        cache.stop_on(None)  # the request that filled it is over
        with self._lock:
            self._held.append(_Held(namespace, tuple(token_ids), cache))
            while sum(len(h.token_ids) for h in self._held) > self.max_tokens:
                self._held.pop(0)

    def take(self, namespace: str, token_ids: Sequence[int]) -> tuple[BufferedCache, int] | None:
        """The held cache that shares the most leading tokens with ``token_ids``, cut back to them (at
        most all but the last: its logits are computed), with their count; None when no held context
        is continued. It is no longer held: the caller's request writes into it.

        A request continues a context when it shares at least half of its tokens: a shared system
        prompt alone does not consume another conversation's context."""
        wanted = max(len(token_ids) - 1, 0)
        with self._lock:
            best, best_shared = None, 0
            for held in self._held:
                if held.namespace != namespace:
                    continue
                shared = min(common_prefix(held.token_ids, token_ids), wanted)
                if shared > best_shared and 2 * shared >= len(held.token_ids):
                    best, best_shared = held, shared
            if best is None:
                return None
            self._held.remove(best)
            self.reads += 1
            self.read_tokens += best_shared
        best.cache.truncate(best_shared)
        return best.cache, best_shared

    def clear(self) -> None:
        """Hold nothing (the buffers are released)."""
        with self._lock:
            self._held.clear()

    def stats(self) -> dict[str, int]:
        """Contexts and tokens held now, and the requests (and tokens) that went on from one."""
        with self._lock:
            held = [len(h.token_ids) for h in self._held]
        return {
            "contexts": len(held),
            "held_tokens": sum(held),
            "reads": self.reads,
            "read_tokens": self.read_tokens,
        }
