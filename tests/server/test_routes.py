"""The endpoints over a stand-in engine: what reaches the engine (one :class:`Request`), response shapes,
the OpenAI-shaped errors, health, models and the metrics middleware. No model runs here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from kvboost_rag.async_stream import AsyncStream, StreamBridge
from kvboost_rag.errors import ContextWindowExceededError
from kvboost_rag.request import Request
from kvboost_rag.results import GenerationResult, StreamChunk, Timings, Usage
from kvboost_rag.server import create_app
from kvboost_rag.server.routes import endpoint_label

USER = [{"role": "user", "content": "Hi"}]


def result(text: str = "Hello there") -> GenerationResult:
    usage = Usage(
        prompt_tokens=10,
        completion_tokens=2,
        cached_tokens=8,
        cached_tokens_by_tier={"memory": 8},
        drafted_tokens=5,
        accepted_tokens=3,
    )
    return GenerationResult(text, [1, 2], "length", usage, Timings(ttft_s=0.01, total_s=0.02, prefill_s=0.01))


class FakeEngine:
    """Records the requests it gets and answers at once."""

    model_name = "fake-model"
    namespace = "0123456789abcdef" * 4

    def __init__(self) -> None:
        self.submitted: list[Request] = []
        self.streamed: list[Request] = []
        self.closed = False
        self.refuse: Exception | None = None

    def submit(self, request: Request) -> Future[GenerationResult]:
        self.submitted.append(request)
        future: Future[GenerationResult] = Future()
        if self.refuse is not None:
            future.set_exception(self.refuse)
        else:
            future.set_result(result())
        return future

    def stream(self, request: Request) -> Iterator[StreamChunk]:
        if self.refuse is not None:
            raise self.refuse
        self.streamed.append(request)
        return iter([StreamChunk("Hello"), StreamChunk(" there", result())])

    def astream(self, request: Request) -> AsyncStream:
        return AsyncStream(lambda loop: StreamBridge(self.stream(request), loop))

    def stats(self) -> dict[str, Any]:
        return {"memory": {"entries": 3, "bytes": 100, "hits": 1, "misses": 2}}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, default_max_tokens=32)) as c:  # type: ignore[arg-type]
        yield c
    assert engine.closed  # the app's shutdown closed the engine


def test_chat_sends_one_request_to_the_engine(client, engine):
    r = client.post(
        "/v1/chat/completions", json={"model": "x", "messages": USER, "temperature": 0, "stop": "."}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert body["system_fingerprint"] == "kv-0123456789abcdef"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello there"}
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert body["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 3,
        "rejected_prediction_tokens": 2,
    }
    assert body["kvboost"]["cached_tokens_by_tier"] == {"memory": 8}
    assert engine.submitted == [Request(USER, max_new_tokens=32, temperature=0.0, stop=".")]


def test_a_stream_gets_one_request_and_sends_openai_chunks(client, engine):
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert engine.streamed == [Request("Hi", max_new_tokens=2, temperature=1.0)]
    assert events.pop() == "[DONE]"
    chunks = [json.loads(e) for e in events]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ["Hello", " there", ""]
    assert chunks[2]["choices"][0]["finish_reason"] == "length" and "kvboost" in chunks[2]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 2
    assert len({c["id"] for c in chunks}) == 1


def test_a_setting_the_request_refuses_is_a_400_before_the_engine(client, engine):
    r = client.post("/v1/completions", json={"prompt": "Hi", "seed": 2**70})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "seed must be an integer" in error["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("stream", [False, True])
def test_the_engine_refusing_a_prompt_names_the_field(client, engine, stream):
    engine.refuse = ContextWindowExceededError("the prompt does not fit; shorten the prompt")
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
    assert r.status_code == 400
    assert r.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }


def test_models_health_and_unknown_paths(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    assert client.get("/v1/models/fake-model").json()["owned_by"] == "kvboost-rag"
    missing = client.get("/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = client.get("/health").json()
    assert health == {
        "status": "ok",
        "model": "fake-model",
        "in_flight": 0,
        "queue_depth": 0,
        "max_queue": 64,
    }
    nowhere = client.get("/v2/anything")
    assert nowhere.status_code == 404 and "/v1/chat/completions" in nowhere.json()["error"]["message"]


def test_a_draining_app_refuses_generation_and_fails_health(client):
    client.app.state.kvboost.begin_drain()
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_shutting_down"


def test_the_middleware_counts_requests_by_endpoint_and_status(client):
    client.get("/v1/models/fake-model")
    client.get("/favicon.ico")
    text = client.get("/metrics").text
    assert 'kvboost_http_requests_total{endpoint="/v1/models",status="200"} 1' in text
    assert 'kvboost_http_requests_total{endpoint="other",status="404"} 1' in text
    assert 'kvboost_store_entries{tier="memory"} 3' in text


def test_endpoint_labels():
    assert endpoint_label("/v1/completions") == "/v1/completions"
    assert endpoint_label("/v1/models/a/b") == "/v1/models"
    assert endpoint_label("/v1/embeddings") == "other"


def test_create_app_checks_its_options(engine):
    with pytest.raises(ValueError, match="max_queue"):
        create_app(engine, max_queue=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_timeout_s"):
        create_app(engine, request_timeout_s=0)  # type: ignore[arg-type]
