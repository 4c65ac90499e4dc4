"""Prompt pieces and the text rules every prompt follows, whichever way it is tokenized.

A prompt is a list of :class:`Segment` (a document, a message, template glue); its text is
normalized (:func:`normalize_text`) and cut at paragraph breaks (:func:`split_paragraphs`) the
same way at indexing and at query time, and :class:`CanonicalPrompt` pairs the segments with
their token ids.

>>> normalize_text("a\\r\\nb\\rc")
'a\\nb\\nc'
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, TypeGuard

from .errors import InvalidRequestError

SegmentKind = Literal["text", "document", "message", "glue", "closing"]
"""Template text is ``glue`` when it opens the content after it (``<|im_start|>user\\n``) and
``closing`` when it ends the message before it (``<|im_end|>\\n``); each is chunked together
with the content it belongs to, so a message's chunks are the same in every later turn."""


def normalize_text(text: str) -> str:
    """Line endings to ``\\n`` and Unicode NFC: the same at indexing and at query time.

    Text that is not valid Unicode (a lone UTF-16 surrogate, as JSON's ``"\\ud800"`` gives) is refused:

    >>> normalize_text("ok \\ud800")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    kvboost_rag.errors.InvalidRequestError: the text has a lone surrogate '\\ud800' at character 3; ...
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        msg = (
            f"the text has a lone surrogate {text[e.start]!r} at character {e.start}; "
            "send valid Unicode (a surrogate pair, or the character itself)"
        )
        raise InvalidRequestError(msg) from None
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))


@dataclass(frozen=True)
class Segment:
    """A span of the prompt with its own identity (a document, a message, template glue)."""

    text: str
    kind: SegmentKind = "text"


Message = Mapping[str, Any]
PromptInput = str | Sequence[str | Segment] | Sequence[Message]


def segments_before(segments: Sequence[Segment], marker: str) -> list[Segment]:
    """The segments that precede ``marker``, ending with the part before it of the segment that holds it.

    Framework adapters render their prompt template with a marker in place of the
    context; what comes before it is the prefix that documents are pre-warmed after.
    The last segment is the one the document continues (its text may be empty).

    >>> segments_before([Segment("sys", "message"), Segment("Context: @@ Q", "message")], "@@")
    [Segment(text='sys', kind='message'), Segment(text='Context: ', kind='message')]
    """
    for i, segment in enumerate(segments):
        if marker in segment.text:
            return [*segments[:i], Segment(segment.text[: segment.text.index(marker)], segment.kind)]
    msg = (
        "the rendered prompt lost the context placeholder; the chat template must keep message text verbatim"
    )
    raise InvalidRequestError(msg)


_PARAGRAPH_BREAK = re.compile(r"(?<=[^\n])(?=\n\n)")
"""Matches the place before each run of two or more newlines that follows other text."""


def split_paragraphs(segment: Segment) -> list[Segment]:
    """Cut a text segment before each paragraph break (a run of two or more newlines).

    The cut depends on the text alone. A paragraph (a retrieved passage, say) keeps
    the same tokens and chunks whether or not another paragraph follows it, so a
    prompt that continues a pre-warmed ``prefix + document`` with ``"\\n\\n..."`` reuses
    all of it, and a passage that follows a break has the same chunks wherever it
    appears, which lets blend reuse find it. With byte-level BPE tokenizers the
    tokens are those of the uncut text, since a newline run already starts a new token.

    >>> [s.text for s in split_paragraphs(Segment("Context:\\n\\nFirst.\\n\\n\\nSecond"))]
    ['Context:', '\\n\\nFirst.', '\\n\\n\\nSecond']
    """
    if segment.kind in ("glue", "closing"):
        return [segment]
    cuts = [m.start() for m in _PARAGRAPH_BREAK.finditer(segment.text)]
    bounds = zip([0, *cuts], [*cuts, len(segment.text)], strict=True)
    return [Segment(segment.text[a:b], segment.kind) for a, b in bounds]


@dataclass(frozen=True)
class CanonicalPrompt:
    """Segments with their canonical token ids; ``decode(token_ids) == text``."""

    segments: tuple[Segment, ...]
    segment_token_ids: tuple[tuple[int, ...], ...]

    @cached_property
    def token_ids(self) -> list[int]:
        return [t for ids in self.segment_token_ids for t in ids]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    @cached_property
    def segment_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` token offsets of each segment."""
        spans, start = [], 0
        for ids in self.segment_token_ids:
            spans.append((start, start + len(ids)))
            start += len(ids)
        return spans

    def __len__(self) -> int:
        return len(self.token_ids)


def is_messages(prompt: object) -> TypeGuard[Sequence[Message]]:
    """Whether a prompt is a chat message list (rendered through the chat template)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(p, Mapping) for p in prompt)
    )
