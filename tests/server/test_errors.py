"""Every exception becomes OpenAI's error shape with the right status; pydantic complaints name the field."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")

from kvboost_rag.errors import (
    ContextWindowExceededError,
    InvalidRequestError,
    KVBoostError,
    UnsupportedModelError,
)
from kvboost_rag.server.errors import ServerError, error_payload, error_response, validation_message
from kvboost_rag.server.protocol import BadRequest


@pytest.mark.parametrize(
    ("exc", "status", "type_", "param", "code"),
    [
        (
            ServerError(429, "full", "rate_limit_error", "queue_full"),
            429,
            "rate_limit_error",
            None,
            "queue_full",
        ),
        (
            ServerError(504, "slow", "timeout_error", "request_timeout"),
            504,
            "timeout_error",
            None,
            "request_timeout",
        ),
        (BadRequest("bad n", "n"), 400, "invalid_request_error", "n", None),
        (
            ContextWindowExceededError("too long"),
            400,
            "invalid_request_error",
            None,
            "context_length_exceeded",
        ),
        (InvalidRequestError("bad"), 400, "invalid_request_error", None, None),
        (UnsupportedModelError("no blend"), 400, "invalid_request_error", None, None),
        (KVBoostError("store"), 500, "server_error", None, None),
    ],
)
def test_error_response_maps_each_kind(exc, status, type_, param, code):
    response = error_response(exc)
    assert response.status_code == status
    body = json.loads(response.body)
    assert body == {"error": {"message": str(exc), "type": type_, "param": param, "code": code}}
    assert error_payload(exc) == body  # a stream's error event is the same body


@pytest.mark.parametrize(("status", "retry"), [(429, "1"), (503, "1"), (504, None)])
def test_only_passing_refusals_ask_to_retry(status, retry):
    assert error_response(ServerError(status, "x", "server_error")).headers.get("retry-after") == retry


def test_an_unexpected_exception_is_a_logged_500(caplog):
    with caplog.at_level(logging.ERROR, logger="kvboost_rag.server"):
        response = error_response(ZeroDivisionError("division by zero"))
    assert response.status_code == 500
    message = json.loads(response.body)["error"]["message"]
    assert "ZeroDivisionError: division by zero" in message and "server log" in message
    assert any(r.exc_info for r in caplog.records)


def test_validation_message_names_nested_fields_and_drops_union_branches():
    errors = [
        {"type": "string_type", "loc": ("body", "messages", 0, "content", "str"), "msg": "bad", "input": 5}
    ]
    assert validation_message(errors) == (
        "messages[0].content: bad (got 5)",
        "invalid_request_error",
        "messages[0].content",
        None,
    )


def test_validation_message_for_missing_fields_bad_json_and_long_inputs():
    missing = [{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}]
    assert validation_message(missing)[0] == "prompt is required; add it to the request body"
    invalid = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}]
    assert "not valid JSON" in validation_message(invalid)[0] and validation_message(invalid)[2] is None
    long = [{"type": "dict_type", "loc": ("body",), "msg": "not a dict", "input": "x" * 500}]
    message, _, param, _ = validation_message(long)
    assert message.startswith("the request body: not a dict") and message.endswith("...)") and param is None
    assert len(message) < 140
