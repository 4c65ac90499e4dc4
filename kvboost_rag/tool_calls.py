"""Tool calls in the Hermes format (``<tool_call>{json}</tool_call>``), shared by both adapters.

Qwen2.5 and many open models are trained on this format. A chat template that takes
``tools`` renders them itself; for any other template a documented system prompt
(:data:`FALLBACK_PROMPT`) carries them. A forced ``tool_choice`` starts the reply for the
model (:func:`forced_prefix`). Replies are split into content and calls by one parser,
:class:`ReplyParser`, whether they arrive whole or as stream deltas.

>>> add = {"type": "function", "function": {"name": "add", "parameters": {"properties": {}}}}
>>> parser = ReplyParser([add])
>>> parser.push('Sure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
'Sure.'
>>> rest, reply = parser.finish()
>>> reply.content, reply.calls[0].name, reply.calls[0].arguments
('Sure.', 'add', {'a': 1, 'b': 2})
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .canonical import Canonicalizer, Segment

OPEN = "<tool_call>"
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

ToolSpec = Mapping[str, Any]
"""An OpenAI-style tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class InvalidToolCall:
    """A call the model started but that does not parse (its raw text and why)."""

    id: str
    raw: str
    error: str


@dataclass(frozen=True)
class Reply:
    """A model reply split into its plain content and its tool calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[InvalidToolCall] = field(default_factory=list)


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def with_fallback_prompt(messages: list[dict[str, Any]], tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The messages with the tool instructions added to (or as) the system message."""
    text = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(dict(t)) for t in tools))
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [
            {**first, "content": [*first["content"], {"type": "text", "text": "\n\n" + text}]},
            *messages[1:],
        ]
    return [{"role": "system", "content": [{"type": "text", "text": text}]}, *messages]


def forced_prefix(tool_choice: Any, tools: Sequence[ToolSpec]) -> str:
    """Text that starts the assistant's reply so that it must call a tool (or one named tool).

    ``tool_choice``: None/``"auto"``/``"none"``/False (nothing forced), ``"any"``/``"required"``/True
    (some tool), a tool name, or ``{"function": {"name": ...}}`` / ``{"name": ...}``.
    """
    if tool_choice in (None, "auto", "none", False):
        return ""
    name = None
    if isinstance(tool_choice, str) and tool_choice not in ("any", "required"):
        name = tool_choice
    elif isinstance(tool_choice, Mapping):
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


def offer_tools(
    canonicalizer: Canonicalizer, messages: list[dict[str, Any]], options: dict[str, Any]
) -> tuple[list[dict[str, Any]] | list[Segment], ReplyParser]:
    """The prompt of a chat call, and the parser of its reply; takes ``tools`` and ``tool_choice``
    out of the call's ``options`` (the adapters' keyword arguments).

    With tools (and ``tool_choice`` other than ``"none"``) the prompt is segments that offer them,
    ending with the reply start of a forced call, which the parser reads as part of the reply.
    """
    tools, tool_choice = options.pop("tools", None), options.pop("tool_choice", None)
    if not tools or tool_choice == "none":
        return messages, ReplyParser()
    if template_renders_tools(canonicalizer.tokenizer):
        segments = canonicalizer.segments_of(messages, tools=[dict(t) for t in tools])
    else:
        segments = canonicalizer.segments_of(with_fallback_prompt(messages, tools))
    start = forced_prefix(tool_choice, tools)
    return (segments + [Segment(start, "text")] if start else segments), ReplyParser(tools, start)


def _bare_call(text: str, names: set[str]) -> str | None:
    """A reply that is only ``{"name": <bound tool>, "arguments": {...}}`` (small models drop the tags)."""
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    if not body.startswith("{"):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return body if isinstance(data, dict) and data.get("name") in names and "arguments" in data else None


def _escape_inner_quotes(raw: str) -> str:
    """``raw`` with each quote inside a string that does not end it escaped: a quote ends a string
    only where a ``,`` ``:`` ``}`` ``]`` or the end follows it. Small models write ``"say "hi""``."""
    out, in_string, i = [], False, 0
    while i < len(raw):
        char = raw[i]
        if in_string and char == "\\":
            out.append(raw[i : i + 2])
            i += 2
            continue
        if char == '"':
            if not in_string:
                in_string = True
            else:
                rest = raw[i + 1 :].lstrip()
                if not rest or rest[0] in ",:}]":
                    in_string = False
                else:
                    char = '\\"'
        out.append(char)
        i += 1
    return "".join(out)


def _loads(raw: str) -> Any:
    """JSON, or where that fails, JSON with unescaped quotes inside strings repaired."""
    try:
        return json.loads(raw)
    except ValueError as error:
        repaired = _escape_inner_quotes(raw)
        if repaired != raw:
            try:
                return json.loads(repaired)
            except ValueError:
                pass
        raise error  # the error of what the model wrote


def parse(text: str, names: set[str] | None = None) -> Reply:
    """Split a whole reply into content and calls (an unclosed last call is accepted; with ``names``,
    so is a reply that is a bare call object without tags)."""
    raws = _CALL.findall(text)
    if not raws and names:
        bare = _bare_call(text, names)
        if bare is not None:
            raws, text = [bare], OPEN + bare
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for raw in raws:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        try:
            data = _loads(raw)
            name, arguments = data["name"], data.get("arguments", {})
            if isinstance(arguments, str):
                arguments = _loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(call_id, name, arguments))
        except (ValueError, KeyError, TypeError) as e:
            invalid.append(InvalidToolCall(call_id, raw, str(e)))
    content = text.split(OPEN, 1)[0].rstrip() if raws else text
    return Reply(content, calls, invalid)


def _content_safe_length(text: str) -> int:
    """How much of ``text`` is plain content for sure (before any tool call, or any start of one)."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return len(text) - n
    return len(text)


def _coerced(arguments: dict[str, Any], parameters: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` with strings turned into the integer, number or boolean their schema declares
    (small models write ``{"a": "6"}`` for an integer); anything that does not convert is kept."""
    properties = parameters.get("properties") or {}
    out = dict(arguments)
    for name, value in arguments.items():
        kind = (properties.get(name) or {}).get("type")
        if not isinstance(value, str) or kind not in ("integer", "number", "boolean"):
            continue
        text = value.strip()
        if kind == "boolean" and text.lower() in ("true", "false"):
            out[name] = text.lower() == "true"
        elif kind == "integer" and re.fullmatch(r"[+-]?\d+", text):
            out[name] = int(text)
        elif kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
            out[name] = float(text)
    return out


class ReplyParser:
    """Splits a reply that arrives in deltas: :meth:`push` returns the content that is safe to show,
    :meth:`finish` the whole :class:`Reply` (content, calls, invalid calls).

    ``tools``: the offered tools (none: all text is content); ``start``: the text the reply was
    started with (:func:`forced_prefix`). Content stops where a call begins; a reply that opens
    with ``{`` or a code fence is held back, since it may be a bare call object. Arguments are
    coerced to the types their tool's schema declares.
    """

    def __init__(self, tools: Sequence[ToolSpec] = (), start: str = "") -> None:
        self.parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.text = start
        self._shown = 0

    def _show(self, content: str) -> str:
        delta = content[self._shown :]
        self._shown = max(self._shown, len(content))
        return delta

    def push(self, delta: str) -> str:
        """Add generated text; returns the new content that is certain not to be part of a call."""
        self.text += delta
        if not self.parameters:
            return self._show(self.text)
        if self.text.lstrip().startswith(("{", "`")):  # may be a bare call object, fenced or not
            return ""
        # trailing whitespace waits too: a call that follows would be cut from the content with it
        return self._show(self.text[: _content_safe_length(self.text)].rstrip())

    def whole(self, text: str) -> Reply:
        """The reply when it comes in one piece (not streamed)."""
        self.push(text)
        return self.finish()[1]

    def finish(self) -> tuple[str, Reply]:
        """The content not yet returned by :meth:`push`, and the whole reply."""
        if not self.parameters:
            return self._show(self.text), Reply(self.text)
        reply = parse(self.text, set(self.parameters))
        calls = [
            ToolCall(c.id, c.name, _coerced(c.arguments, self.parameters.get(c.name, {})))
            for c in reply.calls
        ]
        return self._show(reply.content), Reply(reply.content, calls, reply.invalid)
