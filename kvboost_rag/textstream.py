"""Generated tokens to text: stop strings and safe streaming deltas.

Deltas never end in a broken UTF-8 sequence (decoders show those as U+FFFD
until the rest of the bytes arrive) and never contain the start of a stop
string that might still complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Accumulates generated ids and yields the text that is safe to show.

    >>> class Tok:
    ...     def decode(self, ids, **kw): return "".join(chr(i) for i in ids)
    >>> ts = TextStream(Tok(), stop=("END",))
    >>> [ts.push(ord(c)) for c in "hi E"]
    ['h', 'i', ' ', '']
    >>> ts.push(ord("N")), ts.push(ord("D")), ts.stopped, ts.text
    ('', '', True, 'hi ')
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the new safe text (maybe empty)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if self.stop:
            # A stop string can only be completed by text that is new since the last emit.
            search_from = max(0, self._emitted - self._longest_stop)
            hits = [i for i in (full.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = full[: min(hits)]
                self.stopped = True
                return self._emit(len(self.text))
        self.text = full
        safe = len(full.rstrip("\ufffd"))
        return self._emit(safe - self._held_stop_prefix(full[:safe]))

    def finish(self) -> str:
        """Everything not yet emitted (call once generation ends)."""
        return self._emit(len(self.text))

    def _held_stop_prefix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        for n in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
