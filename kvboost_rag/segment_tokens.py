"""Canonical token ids of one segment text, for one tokenizer.

Every segment is tokenized on its own, without special tokens, so a document has the same
token ids wherever it appears (DESIGN.md contract 1). Two tokenizer habits would break the
concatenation, and are handled here once: a BOS the tokenizer adds by itself (found, and left
to the caller to add once), and a word-start mark at the start of every input (SentencePiece's
``▁``; segments are then tokenized after an anchor token).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .bounded_memo import BoundedMemo

logger = logging.getLogger(__name__)

Anchor = tuple[str, int]
"""A special token's text and id, tokenized before each segment and dropped from its ids."""


class SegmentTokenizer:
    """Canonical ids of segment texts, memoised by text (``memo_chars`` bounds the memo)."""

    def __init__(self, tokenizer: Any, *, memo_chars: int) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._memo = BoundedMemo[tuple[int, ...]](memo_chars)
        self.bos_id = self._bos_to_prepend()
        """The BOS id when the tokenizer adds one by itself (the caller adds it once, as glue)."""
        self._anchor = self._find_anchor()

    def tokenize(self, text: str) -> tuple[int, ...]:
        """Canonical ids of one (already normalized) segment text; never adds special tokens."""
        return self._memo.get_or(text, self._tokenize_uncached)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _bos_to_prepend(self) -> int | None:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is None:
            return None
        with_special = self.tokenizer.encode("a", add_special_tokens=True)
        without = self.tokenizer.encode("a", add_special_tokens=False)
        return bos if len(with_special) > len(without) and with_special[0] == bos else None

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _tokenize_after(self, anchor: Anchor | None, text: str) -> tuple[int, ...]:
        """Ids of ``text`` tokenized after ``anchor`` (None: on its own)."""
        if anchor is None:
            return tuple(self._encode(text))
        token, token_id = anchor
        ids = self._encode(token + text)
        return tuple(ids[1:]) if ids[:1] == [token_id] else tuple(self._encode(text))

    def _tokenize_uncached(self, text: str) -> tuple[int, ...]:
        return self._tokenize_after(self._anchor, text)

    def _joins_cleanly(self, anchor: Anchor | None) -> bool:
        """Whether segments tokenized after ``anchor`` decode back to their concatenation."""
        pairs = [("Hello", "world"), ("Hello ", "world"), ("a\n", " b"), ("x", "  y ")]
        return all(
            self.decode(self._tokenize_after(anchor, a) + self._tokenize_after(anchor, b)) == a + b
            for a, b in pairs
        )

    def _find_anchor(self) -> Anchor | None:
        """A special token to tokenize segments after, for tokenizers that mark a word start
        at the beginning of every input (SentencePiece's ``▁``): without it, segments
        tokenized on their own would not decode back to their concatenation."""
        if self._joins_cleanly(None):
            return None
        for name in ("unk_token", "pad_token", "eos_token", "bos_token"):
            token = getattr(self.tokenizer, name, None)
            if not isinstance(token, str):
                continue
            ids = self._encode(token)
            if len(ids) == 1 and self._joins_cleanly((token, ids[0])):
                return token, ids[0]
        logger.warning(
            "segments tokenized on their own do not decode back to their concatenation with this tokenizer"
        )
        return None
