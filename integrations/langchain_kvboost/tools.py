"""Tool calling in the Hermes format (``<tool_call>{json}</tool_call>``), which Qwen2.5 and
many open models are trained on; rendered by the model's chat template when it takes
``tools``, else by a documented fallback system prompt."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from langchain_core.messages.tool import InvalidToolCall, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""  # noqa: E501 (the prompt text, kept verbatim)
"""Used when the chat template cannot render tools itself (e.g. SmolLM2): appended to the system prompt."""


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def with_fallback_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the tool instructions added to (or as) the system message."""
    text = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [
            {**first, "content": [*first["content"], {"type": "text", "text": "\n\n" + text}]},
            *messages[1:],
        ]
    return [{"role": "system", "content": [{"type": "text", "text": text}]}, *messages]


def forced_prefix(tool_choice: Any, tools: list[dict[str, Any]]) -> str:
    """Text that starts the assistant's reply so that it must call a tool (or one named tool)."""
    if tool_choice in (None, "auto", "none", False):
        return ""
    name = None
    if isinstance(tool_choice, str) and tool_choice not in ("any", "required"):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
    elif tool_choice in (True, "any", "required") and len(tools) == 1:
        name = tools[0]["function"]["name"]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if name is not None and name not in by_name:
        raise ValueError(f"tool_choice names {name!r}, which is not among the bound tools")
    if name is None:
        return f'{OPEN}\n{{"name": "'
    # Opening the arguments object, and its first key's quote, keeps small models on the JSON track.
    has_args = bool(by_name[name].get("parameters", {}).get("properties"))
    return f'{OPEN}\n{{"name": "{name}", "arguments": {{' + ('"' if has_args else "")


def _bare_call(text: str, tool_names: set[str]) -> str | None:
    """A reply that is only ``{"name": <bound tool>, "arguments": {...}}`` (small models drop the tags)."""
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    if not body.startswith("{"):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return body if isinstance(data, dict) and data.get("name") in tool_names and "arguments" in data else None


def parse(text: str, tool_names: set[str] | None = None) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a reply into its plain content and its tool calls (an unclosed last call is accepted;
    with ``tool_names``, so is a reply that is a bare call object without tags)."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    raws = _CALL.findall(text)
    if not raws and tool_names:
        bare = _bare_call(text, tool_names)
        if bare is not None:
            raws, text = [bare], OPEN + bare
    for raw in raws:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        try:
            data = json.loads(raw)
            name, args = data["name"], data.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name=name, args=args, id=call_id, type="tool_call"))
        except (ValueError, KeyError, TypeError) as e:
            invalid.append(
                InvalidToolCall(name=None, args=raw, id=call_id, error=str(e), type="invalid_tool_call")
            )
    content = text.split(OPEN, 1)[0].strip() if (calls or invalid) else text
    return content, calls, invalid


def content_safe_length(text: str) -> int:
    """How much of ``text`` is plain content for sure (before any tool call, or any start of one)."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return len(text) - n
    return len(text)
