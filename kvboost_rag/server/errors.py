"""Errors as OpenAI-shaped JSON: the server's own refusals, engine errors and pydantic's complaints.

Every error body has OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``), so
OpenAI clients raise their usual exception types (``BadRequestError``, ``RateLimitError``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from ..errors import ContextWindowExceededError, InvalidRequestError, KVBoostError, UnsupportedModelError
from .protocol import BadRequest, error_body

logger = logging.getLogger(__name__)

_SCALAR_TYPES = ("str", "int", "float", "bool", "dict", "list")
"""Names pydantic puts in an error's ``loc`` for the union alternative that failed."""


class ServerError(Exception):
    """A refusal with an HTTP status and an OpenAI error ``type`` and ``code``."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code = status, type_, code


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI-shaped error response for an exception raised while serving a request.

    >>> error_response(BadRequest("n=2 is not supported", "n")).status_code
    400
    >>> full = ServerError(429, "at capacity", "rate_limit_error", "queue_full")
    >>> error_response(full).headers["retry-after"]
    '1'
    """
    status, body = _status_and_body(exc)
    # both pass quickly: a slot frees up, or another instance takes the request
    headers = {"Retry-After": "1"} if status in (429, 503) and isinstance(exc, ServerError) else None
    return JSONResponse(body, status_code=status, headers=headers)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The error event of a stream that fails after it started (same body as a non-streamed error)."""
    return _status_and_body(exc)[1]


def _status_and_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, ServerError):
        return exc.status, error_body(str(exc), exc.type, None, exc.code)
    if isinstance(exc, BadRequest):
        return 400, error_body(str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, ContextWindowExceededError):
        return 400, error_body(str(exc), "invalid_request_error", None, "context_length_exceeded")
    if isinstance(exc, (InvalidRequestError, UnsupportedModelError)):
        return 400, error_body(str(exc), "invalid_request_error")
    if isinstance(exc, KVBoostError):
        return 500, error_body(str(exc), "server_error")
    logger.error("request failed", exc_info=exc)  # not one of ours: a bug, so keep the traceback
    msg = f"the server failed to serve this request ({type(exc).__name__}: {exc}); see the server log"
    return 500, error_body(msg, "server_error")


def validation_message(errors: Sequence[Any]) -> tuple[str, str, str | None, None]:
    """(message, type, param, code) for pydantic's first complaint about a request body.

    >>> validation_message([{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}])
    ('messages is required; add it to the request body', 'invalid_request_error', 'messages', None)
    """
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return (
            "the request body is not valid JSON; send a JSON object with Content-Type: application/json",
            "invalid_request_error",
            None,
            None,
        )
    # a union reports the alternative that failed (`str`, `list[str]`); the caller needs the field only
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_branch(str(part))]
    param = ""
    for part in loc:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    problem = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"{param} is required; add it to the request body"
    else:
        got = repr(first.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."  # the whole body can be the input
        message = f"{param or 'the request body'}: {problem} (got {got})"
    return message, "invalid_request_error", param or None, None


def _is_union_branch(part: str) -> bool:
    return part in _SCALAR_TYPES or "[" in part
