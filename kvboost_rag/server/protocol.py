"""OpenAI request bodies in, OpenAI response bodies out.

Requests are parsed by pydantic (types and ranges), then checked for values this
server does not implement: those are refused with a message that names the
field and the fix rather than silently ignored. Fields this server does not
know at all are ignored, so newer clients keep working.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..canonical import PromptInput
from ..errors import InvalidRequestError
from ..limits import ServerLimits
from ..request import Request
from ..results import GenerationResult

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""OpenAI roles this server renders, and the chat-template role each becomes (``developer`` is
OpenAI's newer name for system instructions)."""


class BadRequest(InvalidRequestError):
    """An invalid request field; ``param`` names it as OpenAI errors do."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# -- request bodies --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """Send one more chunk before ``[DONE]`` with ``usage`` and no choices."""


class _OpenAIOnly(BaseModel):
    """OpenAI fields this server accepts only at their no-op values (see :func:`_refuse_unsupported`)."""

    n: int | None = None
    """Only one choice per request (1 or omitted)."""
    presence_penalty: float | None = None
    """Not implemented: only 0 or omitted (likewise ``frequency_penalty`` and ``logit_bias``)."""
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    """Accepted and ignored."""


class _Sampling(_OpenAIOnly):
    """Knobs shared by both endpoints (OpenAI names; ``top_k`` is an extension)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """Any name is accepted; responses report the served model's name."""
    max_tokens: int | None = Field(default=None, ge=1)
    """None: the server's ``default_max_tokens``."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """None: 1.0, as OpenAI; 0 decodes greedily."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    """Makes sampling repeatable on this server."""
    stop: str | list[str] | None = None
    """Stop strings, trimmed from the output."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    """Partitions the KV cache (as in vLLM): requests share stored KV only with the same salt
    (and API key); a guess at another salt's prompt is never faster."""

    def token_limit(self) -> int | None:
        """The most tokens to generate, as the body asks (None: the server's default)."""
        return self.max_tokens


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class ChatCompletionRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name), else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[Any]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


# -- request checks ------------------------------------------------------------------------------


def _refuse_unsupported(body: _Sampling) -> None:
    if body.n not in (None, 1):
        msg = (
            f"n={body.n} is not supported: this server returns one choice per request; omit n (or send 1) "
            "and repeat the request for more choices"
        )
        raise BadRequest(msg, "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise BadRequest(f"{name} is not supported by this server; omit it or send 0", name)
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported by this server; omit it", "logit_bias")
    if body.stop == "" or (isinstance(body.stop, list) and any(not s for s in body.stop)):
        raise BadRequest("stop strings must be non-empty; remove the empty string from stop", "stop")


def to_request(
    body: _Sampling, prompt: PromptInput, default_max_tokens: int, tenant: str | None = None
) -> Request:
    """The engine request for ``prompt`` with the body's sampling settings.

    Its cache salt is the ``tenant`` (the caller's API key, as a digest) joined with the
    body's ``cache_salt``: a body can partition its tenant's cache further, never reach
    another tenant's.

    Raises :class:`BadRequest` for settings this server does not implement, and
    :class:`~kvboost_rag.errors.InvalidRequestError` (from :class:`~kvboost_rag.request.Request`)
    for values the engine refuses.

    >>> body = CompletionRequest(prompt="Hi", max_tokens=8, stop="END")
    >>> request = to_request(body, "Hi", default_max_tokens=256)
    >>> request.max_new_tokens, request.temperature, request.stop
    (8, 1.0, ('END',))
    """
    _refuse_unsupported(body)
    max_tokens = body.token_limit()
    return Request(
        prompt,
        max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        # OpenAI samples at temperature 1 when none is given; send 0 for greedy decoding.
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=body.stop or None,
        cache_salt=":".join(part for part in (tenant, body.cache_salt) if part) or None,
    )


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the engine's chat input: each text part stays its own segment."""
    if body.tools or body.functions:
        param = "tools" if body.tools else "functions"
        raise BadRequest(f"{param} are not supported by this server; send the request without {param}", param)
    if body.tool_choice not in (None, "none", "auto"):
        raise BadRequest(
            "tool_choice needs tools, which this server does not support; omit tool_choice", "tool_choice"
        )
    if body.logprobs or body.top_logprobs:
        raise BadRequest(
            "logprobs are not supported by this server; omit logprobs and top_logprobs", "logprobs"
        )
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        kind = body.response_format.get("type")
        raise BadRequest(
            f"response_format {kind!r} is not supported; omit response_format (plain text replies)",
            "response_format",
        )
    if not body.messages:
        raise BadRequest(
            "messages is empty; send at least one message, e.g. {'role': 'user', 'content': '...'}",
            "messages",
        )
    out = []
    for i, message in enumerate(body.messages):
        role = ROLES.get(message.role)
        if role is None:
            extra = " (tool calling is not supported)" if message.role in ("tool", "function") else ""
            msg = (
                f"messages[{i}].role is {message.role!r}{extra}; use one of "
                f"{', '.join(repr(r) for r in ROLES)}"
            )
            raise BadRequest(msg, f"messages[{i}].role")
        if message.tool_calls:
            raise BadRequest(
                f"messages[{i}] carries tool_calls, which this server does not support; send its text "
                "content only",
                f"messages[{i}].tool_calls",
            )
        content: str | list[dict[str, str]]
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    msg = (
                        f"messages[{i}].content[{j}] is a {part.type!r} part; this server serves text "
                        "models, send {'type': 'text', 'text': ...} parts only"
                    )
                    raise BadRequest(msg, f"messages[{i}].content")
            content = [{"type": "text", "text": part.text or ""} for part in message.content]
        else:
            content = message.content or ""
        out.append({"role": role, "content": content})
    return out


def completion_prompt(body: CompletionRequest) -> str:
    """The raw prompt string of a completions request (used as is, without a chat template)."""
    if body.echo:
        raise BadRequest("echo is not supported by this server; omit it or send false", "echo")
    if body.suffix:
        raise BadRequest("suffix (insertion) is not supported by this server; omit it", "suffix")
    if body.best_of not in (None, 1):
        raise BadRequest("best_of is not supported by this server; omit it or send 1", "best_of")
    if body.logprobs:
        raise BadRequest("logprobs are not supported by this server; omit logprobs", "logprobs")
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            msg = (
                "prompt must be one string (lists of several prompts and token-id prompts are not "
                "supported); send one request per prompt"
            )
            raise BadRequest(msg, "prompt")
        prompt = prompt[0]
    if not prompt:
        raise BadRequest("prompt is empty; send a non-empty prompt string", "prompt")
    return prompt


# -- response bodies -----------------------------------------------------------------------------


def new_id(kind: Literal["chat", "completion"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(result: GenerationResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        # speculative decoding's drafts, in the fields OpenAI gives predicted tokens
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_tokens,
            "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens,
        },
    }


class Shaper:
    """Builds the response and chunk bodies of one request (same id, creation time and model)."""

    def __init__(self, kind: Literal["chat", "completion"], model: str, fingerprint: str | None) -> None:
        self.kind = kind
        self.id = new_id(kind)
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def response(self, result: GenerationResult) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": result.finish_reason,
            }
            body = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": result.text,
                "logprobs": None,
                "finish_reason": result.finish_reason,
            }
            body = self._head("text_completion")
        return body | {"choices": [choice], "usage": usage(result), "kvboost": result.reuse_report()}

    def chunk(
        self,
        text: str | None = None,
        *,
        role: bool = False,
        finish_reason: str | None = None,
        with_usage_field: bool = False,
    ) -> dict[str, Any]:
        """One streamed choice delta. ``with_usage_field``: ``"usage": null``, as OpenAI sends on every
        chunk but the usage one when ``stream_options.include_usage`` is set."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if role else {}
            if text and not role:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(result)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def check_limits(body: _Sampling, limits: ServerLimits) -> None:
    """Refuse a body that asks for more than ``limits`` allow, naming the field and the limit."""
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > limits.max_stop:
        raise BadRequest(f"{len(stops)} stop strings; this server takes at most {limits.max_stop}", "stop")
    max_tokens = body.token_limit()
    if max_tokens is not None and max_tokens > limits.max_tokens_cap:
        msg = f"max_tokens={max_tokens} is above this server's cap of {limits.max_tokens_cap}; ask for fewer"
        raise BadRequest(msg, "max_tokens")
    if not isinstance(body, ChatCompletionRequest):
        return
    if len(body.messages) > limits.max_messages:
        msg = f"{len(body.messages)} messages; this server takes at most {limits.max_messages} per request"
        raise BadRequest(msg, "messages")
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list) and len(message.content) > limits.max_content_parts:
            msg = (
                f"message {i} has {len(message.content)} content parts; "
                f"this server takes at most {limits.max_content_parts} per message"
            )
            raise BadRequest(msg, "messages")
