"""`kvboost-rag serve`: the official OpenAI client and LangChain's ChatOpenAI over real HTTP, streaming,
errors, the request queue, timeouts, cancellation, /metrics and a draining shutdown."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from helpers import record_admissions, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.assembler.buffered_cache import BufferedLayer
from kvboost_rag.limits import ServerLimits

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kvboost_rag.server import create_app, create_server  # noqa: E402  (needs fastapi: skipped above without it)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
SYSTEM = (
    "A key-value cache stores attention keys and values per token. Chunks never cross a segment boundary. "
)
LONG = "The quick brown fox jumps over the lazy dog. " * 400  # ~7600 tokens: beyond the 2048-token window


def tiny_engine() -> KVBoostEngine:
    engine = KVBoostEngine(
        tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16), model_name=MODEL
    )
    engine.eos_ids = (
        frozenset()
    )  # random weights: never stop early, so every answer has exactly max_tokens tokens
    return engine


def chat(system: str, question: str = "Why?") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served(NamedTuple):
    url: str
    service: Any  # the app's state: admission, metrics, live streams


@contextmanager
def running(app: Any) -> Iterator[Served]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a background thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = create_server(app, host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="the server to start")
    assert thread.is_alive(), "the server did not start"
    try:
        yield Served(f"http://127.0.0.1:{port}", app.state.kvboost)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[KVBoostEngine]:
    engine = tiny_engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(engine: KVBoostEngine) -> Iterator[Served]:
    with running(create_app(engine, model_name=MODEL, close_engine=False)) as s:
        yield s


@pytest.fixture
def client(served: Served) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def model_busy(engine: KVBoostEngine) -> Any:
    """Hold the engine's prefill lock: requests get admitted (and queue up) but none can start."""
    return engine.core.lock


def count_decoded_tokens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the tokens the engine decodes from now on: those of the scheduler's batches (a lone
    request's too) and of the single-request loop (``max_batch_size=1``, blend)."""
    import kvboost_rag.generation as generation_module
    from kvboost_rag.batch import RunningBatch

    count = [0]
    real_decode, real_step = generation_module.decode, RunningBatch.step

    def counting(*args: Any, **kwargs: Any) -> Iterator[int]:
        for token in real_decode(*args, **kwargs):
            count[0] += 1
            yield token

    def step(self: RunningBatch) -> bool:
        count[0] += len(self)  # a token for each running row (those that end with it included)
        return real_step(self)

    monkeypatch.setattr(generation_module, "decode", counting)
    monkeypatch.setattr(RunningBatch, "step", step)
    return count


# -- Prometheus text ---------------------------------------------------------------------------

SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)')
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by (name, labels); asserts the exposition format's rules along the way."""
    types: dict[str, str] = {}
    samples = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped") and name not in types
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.fullmatch(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        name, labels, value = match.groups()
        family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in types, f"{name} has no # TYPE line before it"
        if types[family] == "counter":
            assert name.endswith("_total"), name
        samples[(name, tuple(LABEL.findall(labels or "")))] = float(value)
    return samples


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_prometheus(r.text)


# -- the OpenAI client ---------------------------------------------------------------------------


def test_chat_completion_has_openai_shape_and_reuses_a_repeated_prompt(client):
    messages = chat(SYSTEM + "(shape)")
    first = client.chat.completions.create(model="any-name", messages=messages, max_tokens=6, temperature=0)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-") and first.created > 0
    assert first.model == MODEL  # any requested name is served by the loaded model, and reported as such
    choice = first.choices[0]
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    assert choice.message.content
    u = first.usage
    assert u.completion_tokens == 6 and u.total_tokens == u.prompt_tokens + 6
    assert u.prompt_tokens_details.cached_tokens == 0
    assert first.kvboost["recomputed_tokens"] == u.prompt_tokens and first.kvboost["ttft_s"] > 0

    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens > 0
    # the first request's held context, its last chunk laid from the memory tier with its logits
    tiers = again.kvboost["cached_tokens_by_tier"]
    assert set(tiers) <= {"context", "memory"} and sum(tiers.values()) == again.usage.prompt_tokens


def test_streamed_chat_equals_the_non_streamed_answer(client):
    messages = chat(SYSTEM + "(stream)", "What is stored?")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1  # one event per delta, not one at the end
    assert "".join(deltas) == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (
        len(finals) == 1
        and finals[0].choices[0].finish_reason == "length"
        and "kvboost" in finals[0].model_extra
    )
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert (
        usage_chunk.usage.prompt_tokens_details.cached_tokens == usage_chunk.usage.prompt_tokens
    )  # stored by `whole`
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_endpoint_streams_and_not(client):
    prompt = "The quick brown fox jumps over the lazy dog."
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=1, temperature=0, seed=1)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens


def test_langchain_chat_openai_over_http(served):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{served.url}/v1",
        api_key="x",
        model=MODEL,
        temperature=0,
        max_tokens=6,
        max_retries=0,
        stream_usage=True,
    )
    messages = [("system", SYSTEM + "(langchain)"), ("human", "What is a chunk?")]
    first = llm.invoke(messages)
    assert first.content and first.usage_metadata["output_tokens"] == 6
    assert first.response_metadata["model_name"] == MODEL
    chunks = list(llm.stream(messages))
    assert "".join(c.content for c in chunks) == first.content
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.usage_metadata["input_token_details"]["cache_read"] == merged.usage_metadata["input_tokens"]


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4o")
    r = httpx.get(f"{served.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == MODEL


def test_metrics_are_prometheus_text_and_counters_move(client, served):
    before = scrape(served.url)
    client.chat.completions.create(
        model=MODEL, messages=chat(SYSTEM + "(metrics)"), max_tokens=3, temperature=0
    )
    after = scrape(served.url)
    ok = ("kvboost_http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0) + 1
    for name, grew_by in (("kvboost_completion_tokens_total", 3), ("kvboost_ttft_seconds_count", 1)):
        assert after[(name, ())] == before[(name, ())] + grew_by
    assert after[("kvboost_prompt_tokens_total", ())] > before[("kvboost_prompt_tokens_total", ())]
    assert after[("kvboost_requests_in_flight", ())] == 0 and after[("kvboost_queue_capacity", ())] == 64
    assert after[("kvboost_store_entries", (("tier", "memory"),))] > 0
    buckets = [v for (name, labels), v in after.items() if name == "kvboost_ttft_seconds_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == after[("kvboost_ttft_seconds_count", ())]
    duration = ("kvboost_http_request_duration_seconds_count", (("endpoint", "/v1/chat/completions"),))
    assert after[duration] >= 1


# -- errors --------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("path", "body", "words", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages is empty", "messages"),
        ("/v1/chat/completions", {"model": MODEL}, "messages is required", "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "use one of",
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "{}", "tool_call_id": "1"}]},
            "tool calling is not supported",
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "text models",
            "messages[0].content",
        ),
        ("/v1/chat/completions", {"messages": USER, "n": 2}, "one choice per request", "n"),
        ("/v1/chat/completions", {"messages": USER, "n": 3, "stream": True}, "one choice per request", "n"),
        (
            "/v1/chat/completions",
            {"messages": USER, "presence_penalty": 0.5},
            "omit it or send 0",
            "presence_penalty",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function"}]},
            "without tools",
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "max_tokens": 0},
            "greater than or equal to 1",
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": USER, "temperature": -1}, "temperature", "temperature"),
        ("/v1/chat/completions", {"messages": USER, "stop": ["", "x"]}, "non-empty", "stop"),
        ("/v1/chat/completions", {"messages": USER, "temperature": 1, "seed": 2**64}, "smaller seed", None),
        # once a 500 with a traceback in the log
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800"}]},
            "lone surrogate",
            None,
        ),
        ("/v1/completions", {"prompt": "x\udfff", "stream": True}, "lone surrogate", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG}]},
            "context window",
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG}], "stream": True},
            "context window",
            "messages",
        ),
        ("/v1/completions", {"prompt": ""}, "prompt is empty", "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 3]}, "token-id prompts", "prompt"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "echo"),
    ],
)
def test_bad_requests_get_openai_shaped_400s(served, path, body, words, param):
    # json.dumps escapes a lone surrogate as JSON allows ("\ud800"); httpx's encoder would refuse it
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{served.url}{path}", content=json.dumps(body), headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert words in error["message"] and error["param"] == param


def test_other_errors_are_openai_shaped(client, served):
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{served.url}/v1/nothing-here")
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=1
        )
    assert e.value.code == "context_length_exceeded" and "shorten the prompt" in e.value.message


# -- queue, batching, timeouts, cancellation ----------------------------------------------------------


def post_chat(url: str, question: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": chat(SYSTEM + "(queue)", question), "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body | extra, timeout=60)


def test_a_full_queue_answers_429_and_admitted_requests_finish(engine):
    app = create_app(engine, model_name=MODEL, max_queue=2, close_engine=False)
    with running(app) as s, ThreadPoolExecutor(2) as pool:
        with model_busy(engine):  # the model is busy: admitted requests wait for it
            admission = s.service.admission
            admitted = [pool.submit(post_chat, s.url, "Question 0?")]
            # the first one is taken by the scheduler (and waits for the model), so the second stays queued
            wait_until(
                lambda: len(admission.tickets) == 1 and admission.waiting == 0,
                what="the first request running",
            )
            admitted.append(pool.submit(post_chat, s.url, "Question 1?"))
            wait_until(lambda: len(admission.tickets) == 2, what="two admitted requests")
            refused = post_chat(s.url, "One too many?")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "queue_full" and "--max-queue" in error["message"]
            with (
                openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0) as c,
                pytest.raises(openai.RateLimitError),
            ):
                c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            gauges = scrape(s.url)
            assert (
                gauges[("kvboost_requests_in_flight", ())] == 2 and gauges[("kvboost_queue_depth", ())] >= 1
            )
        assert [f.result().status_code for f in admitted] == [200, 200]
        after = scrape(s.url)
        assert (
            after[("kvboost_http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "429")))]
            == 1
        )


def test_concurrent_requests_are_served_in_one_batch(engine, served, monkeypatch):
    sizes = record_admissions(monkeypatch)
    with ThreadPoolExecutor(4) as pool:
        with model_busy(engine):  # hold the model while four requests arrive; they queue up in the scheduler
            futures = [pool.submit(post_chat, served.url, f"Batch question {i}?") for i in range(4)]
            wait_until(lambda: len(served.service.admission.tickets) == 4, what="four admitted requests")
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in responses)
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses)
    assert sizes and max(sizes) >= 2  # the first one runs alone; those that queued behind it share a batch


def test_official_client_needs_the_servers_api_key(engine):
    app = create_app(engine, model_name=MODEL, api_keys=["sk-right"], close_engine=False)
    messages = chat(SYSTEM + "(keys)")
    with running(app) as s:
        no_key = post_chat(s.url, "Who am I?")  # the official client refuses to send no key at all
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError) as e:
                c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-right", max_retries=0) as c:
            reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            assert reply.usage.completion_tokens == 2
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200


def test_each_api_key_is_a_tenant_of_the_cache(engine):
    # Once, tenant B's right guess at tenant A's private prompt came back fast with cached_tokens > 0.
    app = create_app(engine, model_name=MODEL, api_keys=["sk-tenant-a", "sk-tenant-b"], close_engine=False)
    messages = chat(SYSTEM + "(tenant A's private prompt)")

    def cached(key: str, **extra: Any) -> int:
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0) as c:
            reply = c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body=extra
            )
        return reply.usage.prompt_tokens_details.cached_tokens

    with running(app) as s:
        assert cached("sk-tenant-a") == 0
        assert cached("sk-tenant-b") == 0  # B's guess reads nothing of A's
        assert cached("sk-tenant-a") > 0  # A's own hit
        assert cached("sk-tenant-a", cache_salt="project-x") == 0  # a salt partitions a tenant further
        assert cached("sk-tenant-b", cache_salt="project-x") == 0  # and never reaches across keys
        assert cached("sk-tenant-a", cache_salt="project-x") > 0


def test_a_poisoned_request_in_a_batch_fails_alone(engine, served):
    # Once, a seed of 2**64 or a temperature of 1e-300 inside a batch made every request of it a 500.
    normal = [f"Poison question {i}?" for i in range(4)]
    extremes = [
        {"temperature": 1e-300},
        {"temperature": 1, "top_p": 1e-300},
        {"temperature": 1, "seed": 2**64},
    ]
    with ThreadPoolExecutor(7) as pool:
        with model_busy(engine):  # everything queues up, to be served together
            futures = [pool.submit(post_chat, served.url, q) for q in normal]
            futures += [pool.submit(post_chat, served.url, "Poison?", **extra) for extra in extremes]
            wait_until(lambda: len(served.service.admission.tickets) == 6, what="six admitted requests")
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 6 + [400]
    assert "smaller seed" in responses[-1].json()["error"]["message"]
    alone = [post_chat(served.url, q).json()["choices"][0]["message"]["content"] for q in normal]
    assert [r.json()["choices"][0]["message"]["content"] for r in responses[:4]] == alone


def test_timeouts_answer_504_and_stop_the_generation(engine, monkeypatch):
    decoded = count_decoded_tokens(monkeypatch)
    app = create_app(engine, model_name=MODEL, request_timeout_s=0.5, close_engine=False)
    messages = chat(SYSTEM + "(timeout)")
    with running(app) as s, openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0) as c:
        with model_busy(engine):  # the model is busy past the deadline
            with pytest.raises(openai.APIStatusError) as e:
                c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1000)
            assert e.value.status_code == 504 and e.value.code == "request_timeout"
            assert "did not finish within 0.5 s" in e.value.message
            stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1000, stream=True)
            with pytest.raises(openai.APIError, match="did not finish within 0.5 s"):
                list(stream)
        # Both generations were cancelled: once the model is free they stop at their first token.
        engine.generate(
            messages, max_new_tokens=1
        )  # the scheduler is sequential: the cancelled one ran first
        wait_until(
            lambda: not s.service.running_streams and not s.service.admission.tickets,
            what="the stream to stop",
        )
        assert decoded[0] < 50, "a timed-out request kept generating"
        aborts = scrape(s.url)[
            ("kvboost_stream_aborts_total", (("endpoint", "/v1/chat/completions"), ("reason", "timeout")))
        ]
        assert aborts == 1


def test_a_client_that_disconnects_stops_its_stream(served, monkeypatch):
    decoded = count_decoded_tokens(monkeypatch)
    body = {"model": MODEL, "messages": chat(SYSTEM + "(disconnect)"), "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping a half-read line iterator closes the connection
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # the model is generating
        t0 = time.perf_counter()
        health = httpx.get(f"{served.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["in_flight"] == 1
        assert time.perf_counter() - t0 < 2.0  # the event loop stays free while the model works
    wait_until(
        lambda: not served.service.running_streams and not served.service.admission.tickets,
        what="the stream to stop",
    )
    assert decoded[0] < 1500
    aborts = scrape(served.url)[
        ("kvboost_stream_aborts_total", (("endpoint", "/v1/chat/completions"), ("reason", "disconnect")))
    ]
    assert aborts >= 1


def test_a_client_that_disconnects_leaves_its_batch_and_the_other_streams_finish(engine, served, monkeypatch):
    joined = record_admissions(monkeypatch)
    decoded = count_decoded_tokens(monkeypatch)
    doomed = {"model": MODEL, "messages": chat(SYSTEM + "(left)"), "max_tokens": 1500, "stream": True}
    questions = ["Who stays?", "What is kept?"]

    def answer(question: str, stream: bool) -> str:
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
            messages = chat(SYSTEM + "(stay)", question)
            reply = c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=stream
            )
            if not stream:
                return reply.choices[0].message.content
            return "".join(ch.choices[0].delta.content or "" for ch in reply if ch.choices)

    with ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=doomed, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # it is decoding, alone
            staying = [pool.submit(answer, q, True) for q in questions]
            wait_until(lambda: sum(joined) == 2, what="the two streams to join the running one")
        answers = [f.result() for f in staying]  # the doomed client is gone meanwhile
    wait_until(lambda: not served.service.running_streams, what="the streams to end")
    assert decoded[0] < 1500 + 2 * 12  # the doomed one left the batch
    assert answers == [answer(q, False) for q in questions]  # as each runs alone


# -- fuzzing ------------------------------------------------------------------------------------------

WEIRD_VALUES: list[Any] = [
    None,
    "",
    "x" * 20_000,
    "\ud800",
    -1,
    0,
    2**64,
    2**70,
    -(2**70),
    1e-300,
    1e300,
    float("nan"),
    float("inf"),
    float("-inf"),
    True,
    [],
    {},
    [None],
    {"a": 1},
    "NaN",
    3.5,
    "1",
]
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "n",
    "stream_options",
    "user",
    "cache_salt",
    "presence_penalty",
    "max_completion_tokens",
]


def fuzz_bodies(seed: int, count: int) -> list[bytes]:
    """Malformed, mistyped and extreme chat bodies: fixed cases, then seeded mutations of a good one."""
    import random

    rng = random.Random(seed)
    good = {"model": MODEL, "messages": chat(SYSTEM + "(fuzz)"), "max_tokens": 2}
    fixed = [
        b"",
        b"{",
        b"null",
        b"[]",
        b'"text"',
        b"\xff\xfe{}",
        b'{"model": "m", "messages": [{"role": "us',
        b'{"model":"m","messages":[{"role":"user","content":"\xff\xc0"}]}',  # invalid UTF-8
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":1e999}',
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e20}',
        json.dumps(good | {"messages": [{"role": "user", "content": "hi"}] * 5000}).encode(),  # too many
        json.dumps(good | {"messages": [{"role": "user", "content": "hi"}] * 1000}).encode(),  # too long
        json.dumps(good | {"messages": [{"role": "user", "content": ["a"] * 1000}]}).encode(),
        json.dumps(good | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        json.dumps(good | {"messages": [{"content": "no role"}]}).encode(),
        json.dumps(good | {"messages": [{"role": "user", "content": "\ud800"}]}).encode(),
        json.dumps(good | {"stop": ["s"] * 100}).encode(),
        json.dumps(good | {"temperature": 1, "top_p": 1e-300, "seed": 2**64}).encode(),
    ]
    mutated = []
    for _ in range(count - len(fixed)):
        body: dict[str, Any] = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(FIELDS)
            if rng.random() < 0.2:
                body.pop(field, None)
            elif field == "messages" and rng.random() < 0.5:
                body["messages"][-1][rng.choice(["role", "content", "name"])] = rng.choice(WEIRD_VALUES)
            else:
                body[field] = rng.choice(WEIRD_VALUES)
        mutated.append(
            json.dumps(body).encode()
        )  # NaN and Infinity as JSON extensions, as Python writes them
    return fixed + mutated


def check_answer(r: httpx.Response, streamed: bool) -> None:
    """A well-formed 4xx in OpenAI's shape, or a complete answer (a stream that ends with [DONE])."""
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["message"], error
        return
    if streamed and r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzzed_requests_get_clean_answers_and_leave_the_server_well(engine, monkeypatch):
    url_path = "/v1/chat/completions"
    normal = {
        "model": MODEL,
        "messages": chat(SYSTEM + "(fuzz)", "A normal question?"),
        "max_tokens": 4,
        "temperature": 0,
    }
    limits = ServerLimits(max_body_bytes=1 << 20)
    app = create_app(engine, model_name=MODEL, close_engine=False, max_queue=256, limits=limits)
    with running(app) as served, httpx.Client(base_url=served.url, timeout=60) as http:
        headers = {"content-type": "application/json"}
        t0 = time.perf_counter()
        alone = http.post(url_path, json=normal).json()["choices"][0]["message"]["content"]
        usual_s = time.perf_counter() - t0
        bodies = fuzz_bodies(seed=7, count=120)
        bodies.append(
            b'{"model": "m", "messages": [{"role": "user", "content": "' + b"y" * (2 << 20) + b'"}]}'
        )

        def send(body: bytes) -> None:
            streamed = b'"stream": true' in body
            check_answer(http.post(url_path, content=body, headers=headers), streamed)

        def send_normal(_: int) -> str:
            r = http.post(url_path, json=normal)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(8) as pool:  # fuzz and normal requests share batches
            normal_answers = pool.map(send_normal, range(8))
            list(pool.map(send, bodies))
            assert list(normal_answers) == [alone] * 8

        # clients that leave before their prefill ran: the work stops rather than running to its end
        decoded = count_decoded_tokens(monkeypatch)
        long_body = {"model": MODEL, "messages": chat(LONG[:3000]), "max_tokens": 64, "temperature": 0}
        with model_busy(engine):
            for stream in (True, False):
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(f"{served.url}{url_path}", json=long_body | {"stream": stream}, timeout=0.5)
        wait_until(
            lambda: not served.service.admission.tickets and not served.service.running_streams,
            timeout=60,
            what="abandoned requests to stop",
        )
        assert decoded[0] == 0

        assert http.get("/health").json()["status"] == "ok"
        t0 = time.perf_counter()
        assert send_normal(0) == alone
        assert time.perf_counter() - t0 < 3 * usual_s + 2.0  # no work left behind slows it


# -- load loop and shutdown ----------------------------------------------------------------------------


def test_load_loop_runs_briefly_without_failures(served, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    load = importlib.import_module("server_load")
    settings = load.LoadSettings(
        model=MODEL, system=SYSTEM + "(load)", clients=2, duration_s=2.0, max_requests=50, max_tokens=3
    )
    result = load.run_load(served.url, settings)
    assert result["failures"] == 0, result["errors"]
    assert result["requests"] >= 2 and result["latency_s"]["p50"] > 0 and result["ttft_stream_s"]["n"] >= 1


def test_shutdown_ends_within_the_grace_period_while_long_prefills_run(monkeypatch):
    # Each layer of a prefill forward takes 0.5 s: these prompts would prefill for about 10 s.
    engine = KVBoostEngine(
        tiny_model("llama"),
        tiny_tokenizer(),
        config=EngineConfig(chunk_size=16, max_forward_tokens=64, batch_window_ms=0),
        model_name=MODEL,
    )
    prefills = threading.Event()
    write = BufferedLayer.update

    def slow(layer: BufferedLayer, key_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if key_states.shape[-2] >= 64:  # each layer of a long forward writes its keys here
            prefills.set()
            time.sleep(0.5)
        return write(layer, key_states, *args, **kwargs)

    monkeypatch.setattr(BufferedLayer, "update", slow)
    grace_s = 2.0
    app = create_app(engine, model_name=MODEL, shutdown_grace_s=grace_s)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = create_server(app, log_level="critical")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the server to start")
    body = {"model": MODEL, "messages": chat(LONG[:2400]), "max_tokens": 8}

    def post(stream: bool) -> None:
        try:
            httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": stream}, timeout=60)
        except httpx.HTTPError:
            pass  # the connection is closed at shutdown

    clients = [threading.Thread(target=post, args=(stream,), daemon=True) for stream in (False, True)]
    for client in clients:
        client.start()
    wait_until(prefills.is_set, what="a prefill to start")
    t0 = time.monotonic()
    server.should_exit = True
    thread.join(timeout=30)
    elapsed = time.monotonic() - t0
    sock.close()
    assert not thread.is_alive()
    # the grace period, plus one layer's work for the cancelled prefills to notice
    assert elapsed < grace_s + 2.0, elapsed
    assert app.state.kvboost.closed


def test_serve_command_drains_and_flushes_the_store_on_sigterm(tmp_path):
    model_dir, store = tmp_path / "tiny", tmp_path / "store"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvboost_rag.cli",
        "serve",
        str(model_dir),
        "--store",
        str(store),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--chunk-size",
        "16",
        "--served-model-name",
        "tiny",
        "--log-level",
        "warning",
    ]
    # the key from the environment, where the process list does not show it
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "KVBOOST_API_KEY": "sk-cli"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=90, what="the server to start")
        body = {"model": "tiny", "messages": chat(SYSTEM), "max_tokens": 16, "temperature": 0, "stream": True}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        key = {"Authorization": "Bearer sk-cli"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=key, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # admitted and streaming
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the stream in flight runs to its end
        assert "data: [DONE]" in rest
        assert any('"finish_reason":"' in line for line in rest)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (0, -signal.SIGTERM), stderr
    assert "Traceback" not in stderr, stderr
    from kvboost_rag.store import DiskStore

    disk = DiskStore(store, namespace="", background_writes=False)
    try:
        assert (
            sum(row["entries"] for row in disk.usage().values()) > 0
        )  # the prompt's chunks reached the disk
    finally:
        disk.close()
