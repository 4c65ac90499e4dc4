"""EngineConfig: defaults per schedule, and secrets that never leave in a dump or a repr."""

from __future__ import annotations

import json

from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.config import redacted_url
from kvboost_rag.store.redis_options import RedisOptions

URL = "redis://:s3cret-pw@127.0.0.1:1/0"  # nothing listens on port 1: opening the tier sends nothing


def test_chunk_size_defaults_to_the_schedules():
    assert EngineConfig().chunk_tokens(invariant=True) == 64
    assert EngineConfig().chunk_tokens(invariant=False) == 1024
    assert EngineConfig(chunk_size=128).chunk_tokens(invariant=True) == 128


def test_redis_secrets_stay_out_of_dumps_and_reprs():
    config = EngineConfig(
        redis_url=URL, redis_options={"password": "pw-2", "client_options": {"password": "pw-3"}}
    )
    shown = [config.model_dump_json(), json.dumps(config.model_dump()), repr(config), str(config)]
    shown.append(repr(RedisOptions(password="pw-2", client_options={"password": "pw-3"})))
    for text in shown:
        assert "s3cret" not in text and "pw-2" not in text and "pw-3" not in text
    assert config.redis_url == URL and config.redis_options["password"] == "pw-2"  # the engine reads these
    assert config.model_dump()["redis_url"] == "redis://:***@127.0.0.1:1/0"
    assert redacted_url("rediss://user:pw@host:6380/2") == "rediss://user:***@host:6380/2"


def test_from_pretrained_keeps_the_real_secrets(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    config = EngineConfig(redis_url=URL, prefill_schedule="canonical")
    engine = KVBoostEngine.from_pretrained(str(tmp_path), config=config, dtype="float32", chunk_size=16)
    try:
        assert engine.config.redis_url == URL and engine.config.chunk_size == 16
        assert [tier.name for tier in engine.store.tiers] == ["memory", "redis"]
    finally:
        engine.close()
