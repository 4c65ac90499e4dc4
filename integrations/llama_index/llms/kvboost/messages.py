"""LlamaIndex chat messages to kvboost chat messages (each text block stays its own segment)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock

from kvboost_rag.errors import InvalidRequestError

# Roles some providers use, mapped to the roles chat templates know.
_ROLES = {
    MessageRole.DEVELOPER: "system",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.FUNCTION: "tool",
}


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Role/content dicts for the model's chat template.

    >>> to_chat_messages([ChatMessage(role="user", content="Hi")])
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}]
    """
    if not messages:
        raise InvalidRequestError("the message list is empty; pass at least one ChatMessage")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        blocks = []
        for block in message.blocks:
            if not isinstance(block, TextBlock):
                msg = (
                    f"message {i} has a {type(block).__name__}; KVBoost serves text models, "
                    "pass text blocks only"
                )
                raise InvalidRequestError(msg)
            if block.text:
                blocks.append({"type": "text", "text": block.text})
        item: dict[str, Any] = {"role": _ROLES.get(message.role, message.role.value), "content": blocks}
        if "tool_call_id" in message.additional_kwargs:
            item["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        out.append(item)
    return out
