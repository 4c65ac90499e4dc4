"""A memo by text whose memory is bounded by the characters of its keys."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V", str, tuple[int, ...])


class BoundedMemo(Generic[V]):
    """A thread-safe memo by text that holds at most ``max_chars`` characters of keys, least recently
    used dropped first; a key longer than an eighth of that is computed every time instead.

    The values (token ids, rendered templates) grow with their keys, so the key characters bound
    the memo's memory whatever the texts are.

    >>> memo = BoundedMemo[str](max_chars=64)
    >>> memo.get_or("abcd", str.upper), memo.get_or("abcd", str.lower)
    ('ABCD', 'ABCD')
    >>> memo.get_or("x" * 9, str.upper) and len(memo)  # 9 > 64 / 8: not kept
    1
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get_or(self, key: str, compute: Callable[[str], V]) -> V:
        """The value memoised for ``key``, else ``compute(key)`` (kept when it fits)."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                return value
        value = compute(key)
        if len(key) * 8 > self.max_chars:
            return value
        with self._lock:
            if key not in self._entries:
                self._chars += len(key)
            self._entries[key] = value
            while self._chars > self.max_chars:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        """Characters of the keys held now."""
        return self._chars
