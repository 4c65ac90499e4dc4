"""LangChain messages to kvboost chat messages (each text block stays its own segment)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from kvboost_rag.errors import InvalidRequestError

# Blocks an assistant message may carry besides text; its tool calls are read from ``tool_calls``.
_AI_NON_TEXT = {"tool_use", "tool_call", "tool_call_chunk", "reasoning", "thinking"}


def _blocks(message: BaseMessage, index: int) -> list[dict[str, str]]:
    content = message.content
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks = []
    for block in content:
        if isinstance(block, str):
            blocks.append({"type": "text", "text": block})
        elif isinstance(block, dict) and block.get("type") == "text":
            blocks.append({"type": "text", "text": str(block.get("text", ""))})
        elif isinstance(message, AIMessage) and isinstance(block, dict) and block.get("type") in _AI_NON_TEXT:
            continue
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            msg = (
                f"message {index} has a {kind!r} content block; "
                "ChatKVBoost serves text models, pass text blocks only"
            )
            raise InvalidRequestError(msg)
    return blocks


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Role/content dicts for the model's chat template."""
    if not messages:
        raise InvalidRequestError("the message list is empty; pass at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if isinstance(message, SystemMessage):
            item: dict[str, Any] = {"role": "system", "content": _blocks(message, i)}
        elif isinstance(message, HumanMessage):
            item = {"role": "user", "content": _blocks(message, i)}
        elif isinstance(message, AIMessage):
            item = {"role": "assistant", "content": _blocks(message, i)}
            if message.tool_calls:
                item["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id"),
                        "function": {"name": c["name"], "arguments": c["args"]},
                    }
                    for c in message.tool_calls
                ]
        elif isinstance(message, ToolMessage):
            content = message.content if isinstance(message.content, str) else json.dumps(message.content)
            item = {
                "role": "tool",
                "content": [{"type": "text", "text": content}],
                "tool_call_id": message.tool_call_id,
            }
        elif isinstance(message, ChatMessage):
            item = {"role": message.role, "content": _blocks(message, i)}
        else:
            msg = (
                f"message {i} is a {type(message).__name__}, which ChatKVBoost cannot render; "
                "use System, Human, AI, Tool or Chat messages"
            )
            raise InvalidRequestError(msg)
        out.append(item)
    return out
