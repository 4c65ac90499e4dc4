"""LlamaIndex chat messages to kvboost chat messages (each text block stays its own segment)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ThinkingBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

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
        blocks, calls = [], []
        for block in message.blocks:
            if isinstance(block, TextBlock):
                if block.text:
                    blocks.append({"type": "text", "text": block.text})
            elif isinstance(block, ToolCallBlock):
                calls.append(_tool_call(block.tool_call_id, block.tool_name, block.tool_kwargs))
            elif not isinstance(block, ThinkingBlock):  # a model's reasoning is not sent back
                msg = (
                    f"message {i} has a {type(block).__name__}; KVBoost serves text models, "
                    "pass text blocks only"
                )
                raise InvalidRequestError(msg)
        # Calls as other LLMs keep them: ToolSelection objects or OpenAI-style dicts.
        for call in message.additional_kwargs.get("tool_calls") or []:
            if isinstance(call, ToolSelection):
                calls.append(_tool_call(call.tool_id, call.tool_name, call.tool_kwargs))
            elif isinstance(call, dict) and "function" in call:
                calls.append(
                    _tool_call(call.get("id"), call["function"]["name"], call["function"]["arguments"])
                )
        item: dict[str, Any] = {"role": _ROLES.get(message.role, message.role.value), "content": blocks}
        if calls:
            item["tool_calls"] = calls
        if "tool_call_id" in message.additional_kwargs:
            item["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        out.append(item)
    return out


def _tool_call(call_id: str | None, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A tool call as chat templates read it (arguments as an object where they parse)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # the template renders the string as it is
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}
