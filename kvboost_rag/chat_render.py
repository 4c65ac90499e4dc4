"""Chat messages rendered through the model's own chat template, as segments.

Each message content, each content block and each piece of template glue becomes a segment, so
a message keeps the same tokens and chunks in every later turn of its conversation.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from .bounded_memo import BoundedMemo
from .errors import InvalidRequestError, UnsupportedModelError
from .segments import Message, Segment, normalize_text

logger = logging.getLogger(__name__)

MESSAGE_END_WINDOW = 8
"""Messages rendered up to each message to find where its text ends: the bound that keeps a
conversation's canonicalization linear in its length (see :meth:`ChatRenderer._message_ends`)."""


class ChatRenderer:
    """Renders chat messages into segments for one tokenizer; ``memo_chars`` bounds the memo of
    template renders by the characters of its keys."""

    def __init__(self, tokenizer: Any, *, memo_chars: int) -> None:
        self.tokenizer = tokenizer
        self._nonce = uuid.uuid4().hex[:12]  # marker text for contents; per instance, never in user text
        self._memo = BoundedMemo[str](memo_chars)

    def render(
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
        return self._memo.get_or(key, lambda _: self._apply_template(marked, add_generation_prompt, kwargs))

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # jinja raises template-specific errors
            msg = f"the chat template failed to render these messages ({e}); check roles and message order"
            raise InvalidRequestError(msg) from e


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
