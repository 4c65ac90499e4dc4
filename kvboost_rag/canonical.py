"""Canonicalizer: prompts become segments, and segments become canonical tokens.

Every segment is tokenized on its own and the results are concatenated, so a
document has the same token ids wherever it appears (DESIGN.md contract 1).
Chat messages are rendered through the model's own chat template; each message
content, each content block and each piece of template glue becomes a segment.

The parts live beside this module: prompt types and text rules (:mod:`.segments`), the
tokenization of one segment (:mod:`.segment_tokens`) and chat rendering (:mod:`.chat_render`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .chat_render import MESSAGE_END_WINDOW, ChatRenderer
from .errors import InvalidRequestError
from .segment_tokens import SegmentTokenizer
from .segments import (
    CanonicalPrompt,
    Message,
    PromptInput,
    Segment,
    is_messages,
    normalize_text,
    segments_before,
    split_paragraphs,
)

__all__ = [
    "MESSAGE_END_WINDOW",
    "CanonicalPrompt",
    "Canonicalizer",
    "PromptInput",
    "Segment",
    "is_messages",
    "normalize_text",
    "segments_before",
]


class Canonicalizer:
    """Turns prompts into :class:`CanonicalPrompt` for one tokenizer.

    Segment tokenization is memoised by text, so a document that comes back in
    every request is tokenized once; ``memo_chars`` bounds each memo (tokens, template
    renders) by the characters of its keys, so its memory stays bounded whatever the prompts.
    """

    def __init__(self, tokenizer: Any, *, memo_chars: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self._tokens = SegmentTokenizer(tokenizer, memo_chars=memo_chars)
        self._chat = ChatRenderer(tokenizer, memo_chars=memo_chars)

    # -- tokens -----------------------------------------------------------

    def tokenize(self, text: str) -> tuple[int, ...]:
        """Canonical ids of one (already normalized) segment text; never adds special tokens."""
        return self._tokens.tokenize(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokens.decode(ids)

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
        bos_id = self._tokens.bos_id
        if bos_id is not None and ids[0][:1] != (bos_id,):
            segments.insert(0, Segment(self.tokenizer.bos_token, "glue"))
            ids.insert(0, (bos_id,))
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
        """Render chat messages through the chat template, one segment per content block
        (:meth:`ChatRenderer.render <kvboost_rag.chat_render.ChatRenderer.render>`)."""
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
