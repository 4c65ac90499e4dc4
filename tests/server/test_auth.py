"""API keys: 401 in OpenAI's shape without a valid bearer key, /health open, /metrics open on request,
keys gathered from arguments, a file and the environment, and never shown."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402  (needs fastapi: skipped above without it)

from kvboost_rag.server import create_app  # noqa: E402
from kvboost_rag.server.auth import API_KEY_ENV, ApiKeys  # noqa: E402

from .test_routes import USER, FakeEngine  # noqa: E402

KEY = "sk-local-0123456789"


def post_chat(client: TestClient, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=headers or {})
    return r.status_code, r.json()


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (None, "no API key"),
        ("Bearer sk-wrong", "not valid"),
        (f"Basic {KEY}", "not valid"),  # the right key under another scheme
        ("Bearer", "not valid"),
    ],
)
def test_requests_without_a_valid_key_get_openai_401(header, words):
    engine = FakeEngine()
    with TestClient(create_app(engine, api_keys=[KEY])) as client:  # type: ignore[arg-type]
        status, body = post_chat(client, {"Authorization": header} if header else None)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key" and words in body["error"]["message"]
        assert KEY not in str(body) and "sk-wrong" not in str(body)  # no key is echoed back
        assert engine.submitted == []  # nothing reached the engine
        assert client.get("/v1/models").status_code == 401
        assert post_chat(client, {"Authorization": f"Bearer {KEY}"})[0] == 200
        assert post_chat(client, {"Authorization": f"bearer  {KEY} "})[0] == 200  # scheme case, spaces


def test_health_is_open_and_metrics_only_when_public():
    with TestClient(create_app(FakeEngine(), api_keys=[KEY])) as client:  # type: ignore[arg-type]
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 401
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert 'status="401"' in metrics  # refused requests are counted too
    with TestClient(create_app(FakeEngine(), api_keys=[KEY], metrics_public=True)) as client:  # type: ignore[arg-type]
        assert client.get("/metrics").status_code == 200
        assert post_chat(client)[0] == 401


def test_without_keys_everything_is_open():
    with TestClient(create_app(FakeEngine())) as client:  # type: ignore[arg-type]
        assert post_chat(client, {"Authorization": "Bearer anything"})[0] == 200
        assert post_chat(client)[0] == 200


def test_keys_come_from_arguments_file_and_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nk-file-1\n\n  k-file-2  \n")
    keys = ApiKeys.gather(["k-arg"], keys_file, env={API_KEY_ENV: "k-env-1,k-env-2"})
    for key in ("k-arg", "k-file-1", "k-file-2", "k-env-1", "k-env-2"):
        assert keys.accepts(f"Bearer {key}")
    assert not keys.accepts("Bearer # team keys") and not keys.accepts("Bearer ")
    assert repr(keys) == "ApiKeys(5 keys)" and "k-arg" not in repr(vars(keys))
    assert not ApiKeys.gather([], None, env={})  # nothing configured: open
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        ApiKeys.gather([], tmp_path / "missing", env={})
