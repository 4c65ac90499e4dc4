"""Canonicalizer: prompts become segments, and segments become canonical tokens.

Every segment is tokenized on its own and the results are concatenated, so a
document has the same token ids wherever it appears (DESIGN.md contract 1).
Chat messages are rendered through the model's own chat template; each message
content, each content block and each piece of template glue becomes a segment.

>>> normalize_text("a\\r\\nb\\rc")
'a\\nb\\nc'
"""

from __future__ import annotations

import json
import logging
import re
import threading
import unicodedata
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, Literal, TypeGuard, TypeVar

from .errors import InvalidRequestError, UnsupportedModelError

logger = logging.getLogger(__name__)

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


def _content_texts(message: Message, index: int) -> list[str]:
    """Text blocks of one message: a string, or a list of strings / ``{"type": "text"}`` blocks."""
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, Sequence):
        texts = []
        for block in content:
            if isinstance(block, str):
                texts.append(block)
            elif isinstance(block, Mapping) and block.get("type") == "text":
                texts.append(str(block.get("text", "")))
            else:
                msg = (
                    f"message {index} has a content block {block!r} that is not text; "
                    "pass text blocks as {'type': 'text', 'text': ...} or plain strings"
                )
                raise InvalidRequestError(msg)
        return texts
    msg = f"message {index} content must be a string or a list of text blocks, got {type(content).__name__}"
    raise InvalidRequestError(msg)


MESSAGE_END_WINDOW = 8
"""Messages rendered up to each message to find where its text ends: the bound that keeps a
conversation's canonicalization linear in its length (see :meth:`Canonicalizer.render_messages`)."""

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


def is_messages(prompt: object) -> TypeGuard[Sequence[Message]]:
    """Whether a prompt is a chat message list (rendered through the chat template)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(p, Mapping) for p in prompt)
    )


class Canonicalizer:
    """Turns prompts into :class:`CanonicalPrompt` for one tokenizer.

    Segment tokenization is memoised by text, so a document that comes back in
    every request is tokenized once; ``memo_chars`` bounds each memo (tokens, template
    renders) by the characters of its keys, so its memory stays bounded whatever the prompts.
    """

    def __init__(self, tokenizer: Any, *, memo_chars: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._memo = BoundedMemo[tuple[int, ...]](memo_chars)
        self._nonce = uuid.uuid4().hex[:12]  # marker text for contents; per instance, never in user text
        self._render_memo = BoundedMemo[str](memo_chars)
        self._bos_id = self._bos_to_prepend()
        self._anchor: tuple[str, int] | None = None
        self._anchor = self._find_anchor()

    # -- tokens -----------------------------------------------------------

    def _bos_to_prepend(self) -> int | None:
        """The BOS id when the tokenizer adds one by itself (we add it once, as glue)."""
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

    def _joins_cleanly(self, anchor: tuple[str, int] | None) -> bool:
        saved, self._anchor = self._anchor, anchor
        try:
            pairs = [("Hello", "world"), ("Hello ", "world"), ("a\n", " b"), ("x", "  y ")]
            return all(
                self.decode(self._tokenize_uncached(a) + self._tokenize_uncached(b)) == a + b
                for a, b in pairs
            )
        finally:
            self._anchor = saved

    def _find_anchor(self) -> tuple[str, int] | None:
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

    def _tokenize_uncached(self, text: str) -> tuple[int, ...]:
        if self._anchor is None:
            return tuple(self._encode(text))
        anchor, anchor_id = self._anchor
        ids = self._encode(anchor + text)
        return tuple(ids[1:]) if ids[:1] == [anchor_id] else tuple(self._encode(text))

    def tokenize(self, text: str) -> tuple[int, ...]:
        """Canonical ids of one (already normalized) segment text; never adds special tokens."""
        return self._memo.get_or(text, self._tokenize_uncached)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- prompts ----------------------------------------------------------

    def canonicalize(
        self, prompt: PromptInput, *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> CanonicalPrompt:
        """Segments and canonical ids of a string, a list of segments, or chat messages.

        Text is cut at paragraph breaks (:func:`split_paragraphs`); the result depends on
        the prompt alone. ``template_kwargs`` go to the chat template (e.g. ``tools=[...]``).
        """
        segments = self.segments_of(prompt, add_generation_prompt=add_generation_prompt, **template_kwargs)
        segments = [part for s in segments for part in split_paragraphs(s) if part.text]
        if not segments:
            raise InvalidRequestError(
                "the prompt is empty; pass a non-empty string, segment list or message list"
            )
        ids = [self.tokenize(s.text) for s in segments]
        if self._bos_id is not None and ids[0][:1] != (self._bos_id,):
            segments.insert(0, Segment(self.tokenizer.bos_token, "glue"))
            ids.insert(0, (self._bos_id,))
        return CanonicalPrompt(tuple(segments), tuple(ids))

    def segments_of(
        self, prompt: PromptInput, *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[Segment]:
        if isinstance(prompt, str):
            return [Segment(normalize_text(prompt), "text")]
        if isinstance(prompt, Segment):
            return [Segment(normalize_text(prompt.text), prompt.kind)]
        if not isinstance(prompt, Sequence) or len(prompt) == 0:
            msg = (
                f"the prompt is empty or of an unknown type ({type(prompt).__name__}); pass a string, "
                "a list of strings/Segments, or a list of {'role': ..., 'content': ...} messages"
            )
            raise InvalidRequestError(msg)
        if is_messages(prompt):
            return self.render_messages(
                prompt, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        out = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                out.append(Segment(normalize_text(part), "text"))
            elif isinstance(part, Segment):
                out.append(Segment(normalize_text(part.text), part.kind))
            else:
                msg = (
                    f"prompt item {i} is a {type(part).__name__}; "
                    "a segment list holds only strings and Segments"
                )
                raise InvalidRequestError(msg)
        return out

    def render_messages(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[Segment]:
        """Render chat messages through the chat template, one segment per content block.

        Each content block is replaced by a unique marker, the template is rendered
        once, and the output is split at the markers: what lies between markers is
        template glue. The join of the segments is checked against a plain render
        of the real messages; a template that transforms contents falls back to a
        single segment (still exact, only coarser reuse).
        """
        if getattr(self.tokenizer, "chat_template", None) is None:
            msg = (
                "this tokenizer has no chat template, so messages cannot be rendered; "
                "pass a plain string or a segment list instead, or set tokenizer.chat_template"
            )
            raise UnsupportedModelError(msg)
        texts: list[str] = []
        counts: list[int] = []  # content blocks of each message
        real = []
        for i, message in enumerate(messages):
            if "role" not in message:
                raise InvalidRequestError(f"message {i} has no 'role'; every message needs role and content")
            # empty blocks get no marker: templates test `if message.content`
            blocks = [b for b in (normalize_text(t) for t in _content_texts(message, i)) if b]
            texts.extend(blocks)
            counts.append(len(blocks))
            real.append({**message, "content": "".join(blocks)})
        marked = self._marked(messages, counts, first_block=0)
        rendered = self._render_marked(marked, add_generation_prompt, template_kwargs)
        expected = normalize_text(self._apply_template(real, add_generation_prompt, template_kwargs))
        ends = self._message_ends(messages, counts, rendered, template_kwargs)
        segments: list[Segment] = []
        order = []
        position = 0  # offset of the current piece in ``rendered``
        # re.split with a group alternates: glue, block index, glue, block index, ..., glue
        for k, piece in enumerate(re.split(self._marker_pattern, rendered)):
            if k % 2 == 1:
                order.append(int(piece))
                segments.append(Segment(texts[int(piece)], "message"))
                position += len(self._marker(int(piece)))
                continue
            # Glue up to the last message end inside it closes that message; the rest opens the next.
            cuts = [e - position for e in ends if position < e <= position + len(piece)]
            cut = max(cuts) if cuts and segments else 0
            if cut:
                segments.append(Segment(normalize_text(piece[:cut]), "closing"))
            if piece[cut:]:
                segments.append(Segment(normalize_text(piece[cut:]), "glue"))
            position += len(piece)
        if order != list(range(len(texts))) or "".join(s.text for s in segments) != expected:
            logger.warning(
                "the chat template transforms message contents; the rendered prompt is kept as one segment "
                "(exact reuse still works, but only for identical prefixes)"
            )
            return [Segment(expected, "text")]
        return segments

    def _marker(self, block: int) -> str:
        """The text that stands for content block ``block`` in a render."""
        return f"\x02{self._nonce}:{block}\x03"

    @cached_property
    def _marker_pattern(self) -> str:
        return f"\x02{self._nonce}:(\\d+)\x03"

    def _marked(self, messages: Sequence[Message], counts: Sequence[int], first_block: int) -> list[dict]:
        """``messages`` with each content replaced by the markers of its blocks, numbered from
        ``first_block``."""
        marked = []
        block = first_block
        for message, count in zip(messages, counts, strict=True):
            markers = "".join(self._marker(b) for b in range(block, block + count))
            marked.append({**message, "content": markers})
            block += count
        return marked

    def _message_ends(
        self, messages: Sequence[Message], counts: list[int], rendered: str, template_kwargs: dict
    ) -> list[int]:
        """Offsets in ``rendered`` where each message's own text ends.

        Message k ends where a render of the conversation that stops at k ends. Rendering
        every such prefix would cost the square of the message count, so the render covers
        at most :data:`MESSAGE_END_WINDOW` messages up to k (the whole prefix in a short
        conversation; a shorter window where the template refuses to start there). Its text
        after its last marker is then looked for right after that marker in ``rendered``.
        Windows with the same roles and block counts render the same, so most are memoised.
        A template whose window ends differently gives no offset there; its glue then simply
        opens the next content.
        """
        marker_ends = {int(m.group(1)): m.end() for m in re.finditer(self._marker_pattern, rendered)}
        first_blocks = [0]  # global index of each message's first block
        for count in counts:
            first_blocks.append(first_blocks[-1] + count)
        ends = []
        owner = None  # the last message up to k that has a block
        for k in range(len(messages)):
            if counts[k]:
                owner = k
            if owner is None:
                continue
            last_block = first_blocks[owner + 1] - 1
            for j in range(max(0, k - MESSAGE_END_WINDOW + 1), owner + 1):
                window = self._marked(messages[j : k + 1], counts[j : k + 1], first_block=0)
                try:
                    text = self._render_marked(window, False, template_kwargs)
                except InvalidRequestError:
                    continue  # some templates refuse a conversation that starts or ends on this role
                window_ends = [m.end() for m in re.finditer(self._marker_pattern, text)]
                start = marker_ends.get(last_block)
                if window_ends and start is not None:
                    tail = text[window_ends[-1] :]
                    if rendered.startswith(tail, start):
                        ends.append(start + len(tail))
                break
        return ends

    def _render_marked(self, marked: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        """Render messages whose contents are markers, memoised (marked messages hold no text, so
        their renders repeat across turns and across windows of a conversation)."""
        key = json.dumps([marked, add_generation_prompt, kwargs], sort_keys=True, default=str)
        return self._render_memo.get_or(
            key, lambda _: self._apply_template(marked, add_generation_prompt, kwargs)
        )

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # jinja raises template-specific errors
            msg = f"the chat template failed to render these messages ({e}); check roles and message order"
            raise InvalidRequestError(msg) from e
