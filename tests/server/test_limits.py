"""Per-request limits: a body too big gets 413 before it is parsed, too many messages, parts or stop
strings and too large a max_tokens get a 400 naming the field; below them, requests are served."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402  (needs fastapi: skipped above without it)

from kvboost_rag.limits import ServerLimits  # noqa: E402
from kvboost_rag.server import create_app  # noqa: E402

from .test_routes import USER, FakeEngine  # noqa: E402

LIMITS = ServerLimits(max_body_bytes=2000, max_messages=3, max_content_parts=2, max_stop=2, max_tokens_cap=64)


@pytest.fixture
def client():
    engine = FakeEngine()
    with TestClient(create_app(engine, limits=LIMITS)) as c:  # type: ignore[arg-type]
        c.engine = engine  # type: ignore[attr-defined]
        yield c


def post(client: TestClient, body: dict) -> tuple[int, dict]:
    r = client.post("/v1/chat/completions", json=body)
    return r.status_code, r.json()


def test_a_body_over_the_limit_gets_413_declared_or_streamed(client):
    status, body = post(client, {"messages": [{"role": "user", "content": "x" * 3000}]})
    assert (
        status == 413
        and body["error"]["code"] == "request_too_large"
        and "2000-byte" in body["error"]["message"]
    )

    def chunks():  # no Content-Length: the body arrives in pieces
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.engine.submitted == []
    assert post(client, {"messages": USER})[0] == 200  # under the limit: served


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"messages": USER * 4}, "messages", "at most 3"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}]},
            "messages",
            "content parts",
        ),
        ({"messages": USER, "stop": ["a", "b", "c"]}, "stop", "at most 2"),
        ({"messages": USER, "max_tokens": 65}, "max_tokens", "cap of 64"),
        ({"messages": USER, "max_completion_tokens": 1000}, "max_tokens", "cap of 64"),
    ],
)
def test_requests_past_a_limit_get_400_naming_it(client, extra, param, words):
    status, body = post(client, extra)
    assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"]
    assert client.engine.submitted == []


def test_requests_at_the_limits_are_served(client):
    parts = [{"type": "text", "text": "a"}] * 2
    body = {"messages": [*USER * 2, {"role": "user", "content": parts}], "stop": ["a", "b"], "max_tokens": 64}
    assert post(client, body)[0] == 200
    assert client.engine.submitted[-1].max_new_tokens == 64


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_stop must be >= 1"):
        ServerLimits(max_stop=0)
