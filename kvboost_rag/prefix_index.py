"""Stored chunks by the prefix before them: how much of a missing chunk is stored after all.

Chunk keys chain over whole chunks, so a prompt that extends a stored one inside its last chunk
(a question with a line added, an agent's scratchpad that grew) misses that chunk by key. With
the split-invariant forward the KV of token i depends on tokens <= i only, so the first j tokens
of any chunk stored after the same prefix are the prompt's own KV wherever its tokens start with
those j: :class:`PrefixIndex` finds the stored chunk that shares the most leading tokens with the
prompt's first missing chunk, under the same parent key only (keys never lie: a match never
crosses a prefix, a namespace or a tenant's salt), and the runner lays those tokens and computes
the rest, as a radix tree over tokens would, one chunk deep.

The index lives in memory and learns every chunk this process stores or reads; a stale entry
(evicted from the store since) costs one failed read. It holds at most ``max_chunks`` chunks,
forgetting the parents used longest ago.

>>> index = PrefixIndex()
>>> index.add("p", "k1", [1, 2, 3, 4])
>>> index.add("p", "k2", [1, 2, 9])
>>> index.longest_prefix("p", [1, 2, 3, 7, 7])
('k1', 3)
>>> index.longest_prefix("other", [1, 2, 3]) is None
True
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

MAX_CHUNKS = 1 << 16
"""Chunks the index remembers (~256 bytes of tokens each at 64-token chunks)."""


class PrefixIndex:
    def __init__(self, max_chunks: int = MAX_CHUNKS) -> None:
        self.max_chunks = max_chunks
        self._children: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def add(self, parent: str, key: str, token_ids: Sequence[int]) -> None:
        """Remember that chunk ``key`` with ``token_ids`` is stored after the prefix ``parent`` (called
        for every chunk read or stored: a chunk known already costs a lookup, no conversion)."""
        with self._lock:
            children = self._children.setdefault(parent, {})
            self._children.move_to_end(parent)
            if key in children:  # same key, same tokens: keys chain over them
                return
            children[key] = np.asarray(token_ids, dtype=np.uint32)
            self._count += 1
            while self._count > self.max_chunks and len(self._children) > 1:
                _, forgotten = self._children.popitem(last=False)
                self._count -= len(forgotten)

    def discard(self, parent: str, key: str) -> None:
        """Forget one chunk (it is no longer stored)."""
        with self._lock:
            children = self._children.get(parent)
            if children is not None and children.pop(key, None) is not None:
                self._count -= 1
                if not children:
                    del self._children[parent]

    def longest_prefix(self, parent: str, token_ids: Sequence[int]) -> tuple[str, int] | None:
        """The chunk stored after ``parent`` whose tokens share the most leading tokens with
        ``token_ids``, and how many it shares; None when none shares one."""
        wanted = np.asarray(token_ids, dtype=np.uint32)
        with self._lock:
            children = self._children.get(parent)
            if not children:
                return None
            self._children.move_to_end(parent)
            candidates = list(children.items())
        best: tuple[str, int] | None = None
        for key, tokens in candidates:
            n = min(len(tokens), len(wanted))
            differ = np.flatnonzero(tokens[:n] != wanted[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared and (best is None or shared > best[1]):
                best = (key, shared)
        return best
