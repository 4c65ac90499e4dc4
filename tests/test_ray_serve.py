"""kvboost-rag on Ray Serve: a local Ray cluster on this machine, two replicas of a tiny model behind
the OpenAI ingress, sharing a disk tier.

What must hold: requests sharing a prefix land on the replica whose memory tier holds it; a replica
killed under load costs at most its requests in flight, and every later request succeeds; API keys
and tenant salts hold through the ingress; greedy answers are a single engine's.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

pytest.importorskip("ray.serve")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine  # noqa: E402
from kvboost_rag.ray import IngressOptions, ReplicaSpec, build_app  # noqa: E402
from kvboost_rag.ray.app import ENGINE_DEPLOYMENT  # noqa: E402
from kvboost_rag.server.auth import ApiKeys  # noqa: E402

pytestmark = pytest.mark.slow

APP = "kvboost-test"
KEYS = ("key-alice", "key-bob")
PARAGRAPHS = essay_paragraphs(12, max_chars=700)
DOCUMENTS = [" ".join(PARAGRAPHS[3 * k : 3 * k + 3]) for k in range(4)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """The base URL of a running application: 2 engine replicas sharing one disk tier."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(
        model_dir,
        store_dir=str(tmp_path_factory.mktemp("shared-store")),
        engine={"chunk_size": 16},
        torch_threads=1,
    )
    options = IngressOptions(model_name="tiny", api_keys=ApiKeys(KEYS), request_timeout_s=60)
    serve.run(build_app(spec, replicas=2, options=options, replica_cpus=0.5), name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for_running_replicas(n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT].replica_states
        if states.get("RUNNING", 0) == n and sum(states.values()) == n:
            time.sleep(1.0)  # the ingress's router hears of them within a moment
            return
        time.sleep(0.5)
    pytest.fail(f"the engine deployment did not reach {n} running replicas within {timeout_s:.0f} s")


def ask(client: httpx.Client, content: str, *, key: str = KEYS[0], max_tokens: int = 6) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {key}"},
    )


def memory_tokens(response: httpx.Response) -> int:
    """Prompt tokens read from the serving replica's memory: its memory tier or its held contexts."""
    assert response.status_code == 200, response.text
    tiers = response.json()["kvboost"]["cached_tokens_by_tier"]
    return tiers.get("memory", 0) + tiers.get("context", 0)


def test_requests_sharing_a_document_read_it_from_the_memory_of_the_replica_that_holds_it(cluster):
    """Each document's first question computes it; every later one finds it in a replica's memory
    (a replica without it would read the shared disk tier, or compute it)."""
    with httpx.Client(base_url=cluster, timeout=60) as client:
        for document in DOCUMENTS[:2]:
            first = ask(client, document + "\nWhat is it about?")
            assert memory_tokens(first) < 16  # at most the chat template's opening, read to the token
            prompt_tokens = first.json()["usage"]["prompt_tokens"]
            for question in ("Who wrote it?", "Why?", "Name one claim.", "Is it long?", "Summarise it."):
                assert memory_tokens(ask(client, document + "\n" + question)) >= prompt_tokens - 32


def test_answers_are_a_single_engines_and_bad_input_is_a_400(cluster, model_dir):
    engine = KVBoostEngine.from_pretrained(model_dir, config=EngineConfig(chunk_size=16))
    with httpx.Client(base_url=cluster, timeout=60) as client:
        for document in DOCUMENTS[2:]:
            content = document + "\nWhat comes first?"
            served = ask(client, content, max_tokens=12).json()["choices"][0]["message"]["content"]
            alone = engine.generate([{"role": "user", "content": content}], max_new_tokens=12).text
            assert served == alone
        too_long = ask(client, "word " * 5000)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        unknown_key = ask(client, "Hi", key="key-mallory")
        assert unknown_key.status_code == 401
    engine.close()


def test_tenants_never_read_each_others_kv_through_the_ingress(cluster):
    with httpx.Client(base_url=cluster, timeout=60) as client:
        prompt = " ".join(reversed(PARAGRAPHS[:3])) + "\nWho is it for?"  # asked by no other test
        prompt_tokens = ask(client, prompt, key=KEYS[0]).json()["usage"]["prompt_tokens"]
        assert memory_tokens(ask(client, prompt, key=KEYS[0])) >= prompt_tokens - 32
        bob = ask(client, prompt, key=KEYS[1]).json()["kvboost"]
        assert bob["cached_tokens"] == 0  # no tier, shared disk included, gives Alice's KV to Bob


def test_a_streamed_answer_is_the_whole_answer(cluster):
    with httpx.Client(base_url=cluster, timeout=60) as client:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": DOCUMENTS[0] + "\nStream it."}],
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        whole = ask(client, DOCUMENTS[0] + "\nStream it.", max_tokens=10).json()
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in lines[:-1]]
    assert "".join(deltas) == whole["choices"][0]["message"]["content"]


def test_a_replica_killed_under_load_costs_only_its_requests_in_flight(cluster):
    """Eight clients keep asking; one replica is killed. Requests that failed were in flight on it
    (at most what it held); Ray starts a new replica, and every request after the kill succeeds."""
    statuses: list[tuple[float, int]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client_loop(k: int) -> None:
        with httpx.Client(base_url=cluster, timeout=60) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    status = ask(client, DOCUMENTS[k % 4] + f"\nQuestion {k}.", max_tokens=24).status_code
                except httpx.HTTPError:
                    status = 0
                with lock:
                    statuses.append((started, status))

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    replicas = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{ENGINE_DEPLOYMENT}#" in a["name"]
    ]
    assert len(replicas) == 2
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    time.sleep(6.0)
    stop.set()
    for t in threads:
        t.join()
    before = [s for started, s in statuses if started < killed_at]
    after = [s for started, s in statuses if started >= killed_at]
    assert before and all(s == 200 for s in before[: len(before) - 8])  # all but the last round
    failed = [s for s in before if s != 200]
    assert len(failed) <= 8  # at most the requests in flight when it died
    assert after and all(s == 200 for s in after)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert replicas[0]["name"] not in names
    wait_for_running_replicas(2)  # Ray brings the deployment back to two replicas


def test_the_serve_config_file_builds_the_application():
    import yaml

    from kvboost_rag.ray import app_builder

    config = yaml.safe_load((Path(__file__).parents[1] / "examples" / "ray_serve.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "kvboost_rag.ray:app_builder"
    assert isinstance(app_builder(application["args"]), serve.Application)
    with pytest.raises(ValueError, match="unknown argument"):
        app_builder({"model": "smollm2-135m-instruct", "replica": 2})


def test_the_cli_refuses_bad_ray_options_before_loading_anything(capsys):
    from kvboost_rag.cli import main

    assert main(["serve", "--ray", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_the_router_sees_each_tenants_text_apart_and_never_the_salt():
    from kvboost_rag import Request
    from kvboost_rag.ray import Routed

    messages = [{"role": "system", "content": "Notes."}, {"role": "user", "content": "Why?"}]
    alice, bob, shared = (Routed.of(Request(messages, cache_salt=s)).prompt for s in ("alice", "bob", None))
    assert shared == "Notes.\nWhy?"
    assert alice.endswith(shared) and bob.endswith(shared) and alice != bob
    assert "alice" not in alice and "bob" not in bob


def test_a_hot_prefix_spreads_over_the_replicas_once_one_is_busy(cluster):
    """Ten requests on one new document, 0.1 s apart, each decoding a while: the replica holding it
    takes them until its queue is more than the bound ahead, then the other takes some (and does
    not find the document in its memory)."""
    wait_for_running_replicas(2)
    document = " ".join(reversed(PARAGRAPHS[3:6]))  # asked by no other test
    results: list[httpx.Response] = []

    def one(k: int) -> None:
        time.sleep(0.1 * k)  # queues are probed as requests arrive: a burst all sees them empty
        with httpx.Client(base_url=cluster, timeout=120) as client:
            results.append(ask(client, f"{document}\nHot question {k}?", max_tokens=400))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 10 and all(r.status_code == 200 for r in results)
    prompt_tokens = min(r.json()["usage"]["prompt_tokens"] for r in results)
    not_in_memory = [r for r in results if memory_tokens(r) < prompt_tokens - 32]
    assert len(not_in_memory) >= 2  # the first on each replica: one replica alone would have only one


def test_replicas_read_store_secrets_where_they_run_never_from_the_spec(tmp_path, monkeypatch):
    from kvboost_rag.errors import InvalidRequestError

    secret, previous = tmp_path / "secret", tmp_path / "previous"
    secret.write_text("s3cret\n")
    previous.write_text("old-1\n\nold-2\n")
    spec = ReplicaSpec("tiny", store_secret_file=str(secret), store_previous_secret_file=str(previous))
    config = spec.engine_config()
    assert config.store_secret.get_secret_value() == "s3cret"
    assert [s.get_secret_value() for s in config.store_previous_secrets] == ["old-1", "old-2"]
    monkeypatch.setenv("KVBOOST_STORE_SECRET", "from-env")
    assert ReplicaSpec("tiny").engine_config().store_secret.get_secret_value() == "from-env"
    with pytest.raises(ValueError, match="do not travel"):
        ReplicaSpec("tiny", engine={"store_secret": "s3cret"})
    with pytest.raises(InvalidRequestError, match="cannot read the store secret file"):
        ReplicaSpec("tiny", store_secret_file=str(tmp_path / "missing")).engine_config()
