"""Redis tier: bitwise round trips, namespacing, TTL and eviction with pins, garbage and failures as
misses (bounded by the timeouts), exact answers when Redis dies, and two processes sharing one server.

Every test runs its own ``redis-server`` on a free local port; the binary comes from the system
(``make test`` installs it when it can). Without it the tests skip, except under ``CI=true``.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from helpers import assert_same_chunk, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.canonical import Segment
from kvboost_rag.registry import Source
from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.serialization import encode
from kvboost_rag.store.tiered import TieredStore

redis = pytest.importorskip("redis")
from redis_servers import RedisServer, free_port  # noqa: E402

from kvboost_rag.store.redis import RedisStore  # noqa: E402  (after the skip when redis-py is absent)
from kvboost_rag.store.redis_options import RedisOptions  # noqa: E402

NS = "model-a|tok|float32|v1"
LOGGER = "kvboost_rag.store.redis"
FAST = {"connect_timeout_s": 0.2, "timeout_s": 0.3, "backoff_s": 0.2}
"""Short timeouts and back-off, so failure tests stay quick."""
SLACK_S = 0.5
"""Allowance for a loaded machine on top of a timeout."""

PREFIX = "Answer from the documents below.\n\n"
QUESTION = "\n\nQuestion: what is this about?"
DOCUMENT = (
    "The quick brown fox jumps over the lazy dog while the retrieval system sends the same documents "
    "again and again. A key-value cache stores attention keys and values per token, so a document that "
    "was computed once can be read back instead of being computed again. Chunks never cross a segment "
    "boundary, and a document has the same tokens wherever it appears."
)
OTHER_DOCUMENT = (
    "Tabs\tand new lines appear too. Numbers such as 12345 and 67890 are part of the text, and so is "
    "some emoji 🙂 now and then; the model reads all of it as bytes and does not mind at all."
)


# -- servers -----------------------------------------------------------------------------------


@pytest.fixture
def start_redis(redis_binary, tmp_path) -> Iterator:
    """Factory: ``start_redis(*extra_args)`` starts a server; every one is killed after the test."""
    servers: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        servers.append(RedisServer(redis_binary, tmp_path, *extra).start())
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


@pytest.fixture
def server(start_redis) -> RedisServer:
    return start_redis()


@pytest.fixture
def url(server) -> str:
    return server.url


@pytest.fixture
def store(url) -> Iterator[RedisStore]:
    s = RedisStore(url, namespace=NS, **FAST)
    yield s
    s.close()


@pytest.fixture
def raw(url) -> Iterator:
    """A plain client, to look at and tamper with what the store wrote."""
    client = redis.Redis.from_url(url)
    yield client
    client.close()


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A local port that accepts connections and never answers: a hung server."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # the kernel completes handshakes; nobody ever reads or replies
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    listener.close()


# -- data ----------------------------------------------------------------------------------


def key(i) -> str:
    """A prefix-key-like string: fixed length, distinct in its first 12 chars."""
    return f"k{i:03d}".ljust(64, "0")


def chunk(tokens=4, dtype=torch.float32, logits=False, seed=0) -> StoredChunk:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, 2, tokens, 16, generator=g).to(dtype)
    return StoredChunk(
        kv,
        torch.randn(50, generator=g) if logits else None,
        token_ids=tuple(range(seed, seed + tokens)),
        parent_key=key(seed + 1000),
    )


def redis_stats(store: RedisStore):
    return store.stats()["redis"]


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


# -- round trips and keys ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_is_bitwise(store, dtype):
    c = chunk(8, dtype=dtype, logits=True, seed=3)
    assert store.get(key(1)) is None and not store.contains(key(1))
    store.put(key(1), c)
    store.flush()
    assert store.contains(key(1))
    hit = store.get(key(1))
    assert hit is not None and hit.tier == "redis"
    assert_same_chunk(hit.chunk, c)
    s = redis_stats(store)
    assert (s.hits, s.misses, s.puts, s.entries) == (1, 1, 1, 1)
    assert s.bytes == len(encode(c, NS, key(1)))
    assert s.extra["errors"] == 0 and s.extra["corrupt"] == 0


def test_put_returns_before_the_write_and_flush_waits(store, raw):
    store.put(key(1), chunk(seed=1))
    store.flush()
    assert raw.exists(f"kvboost:{NS}:{key(1)}")


def test_keys_are_prefix_namespace_key_and_payloads_are_the_checked_format(url, raw):
    s = RedisStore(url, namespace="ns", key_prefix="deploy1", background_writes=False)
    c = chunk(seed=2)
    s.put("abc", c)
    assert raw.get("deploy1:ns:abc") == encode(c, "ns", "abc")  # the disk tier's format, never pickle
    s.close()


def test_namespaces_and_key_prefixes_do_not_share_entries(url, raw):
    a = RedisStore(url, namespace="model-a", background_writes=False)
    b = RedisStore(url, namespace="model-b", background_writes=False)
    other = RedisStore(url, namespace="model-a", key_prefix="other", background_writes=False)
    a.put(key(1), chunk(seed=1))
    assert a.get(key(1)) is not None
    assert b.get(key(1)) is None and other.get(key(1)) is None
    assert redis_stats(b).entries == 0

    # A payload copied under another namespace's key is refused by its header, not served.
    raw.set(f"kvboost:model-b:{key(1)}", raw.get(f"kvboost:model-a:{key(1)}"))
    assert b.get(key(1)) is None
    assert redis_stats(b).extra["corrupt"] == 1
    assert not raw.exists(f"kvboost:model-b:{key(1)}"), "the foreign entry is removed"
    for s in (a, b, other):
        s.close()


def test_replacing_a_key_serves_the_new_value_and_keeps_the_byte_total(store):
    store.put(key(1), chunk(4, seed=1))
    store.put(key(1), chunk(8, seed=2))
    store.flush()
    assert_same_chunk(store.get(key(1)).chunk, chunk(8, seed=2))
    s = redis_stats(store)
    assert s.entries == 1 and s.bytes == len(encode(chunk(8, seed=2), NS, key(1)))


# -- TTL and eviction ------------------------------------------------------------------------


def test_ttl_expires_unpinned_entries_and_never_pinned_ones(url, raw):
    s = RedisStore(url, namespace=NS, ttl_s=0.8)
    s.put(key(1), chunk(seed=1))
    s.put(key(2), chunk(seed=2), pin=True)
    s.put(key(3), chunk(seed=3))
    s.flush()
    assert 0 < raw.pttl(f"kvboost:{NS}:{key(1)}") <= 800
    assert raw.pttl(f"kvboost:{NS}:{key(2)}") == -1  # pinned: no expiry
    assert s.pin(key(3))  # pinning later removes the expiry too
    assert raw.pttl(f"kvboost:{NS}:{key(3)}") == -1
    time.sleep(1.0)
    assert s.get(key(1)) is None
    assert s.get(key(2)) is not None and s.get(key(3)) is not None
    st = redis_stats(s)
    assert st.entries == 2 and st.pinned == 2
    assert st.extra["expired"] == 1  # the records of the expired entry are gone too
    assert st.bytes == sum(len(encode(chunk(seed=i), NS, key(i))) for i in (2, 3))
    assert s.pin(key(3), False)  # unpinned: it expires again
    assert 0 < raw.pttl(f"kvboost:{NS}:{key(3)}") <= 800
    s.close()


def test_reads_renew_the_ttl(url, raw):
    s = RedisStore(url, namespace=NS, ttl_s=2.0)
    s.put(key(1), chunk(seed=1))
    s.flush()
    time.sleep(0.5)
    assert raw.pttl(f"kvboost:{NS}:{key(1)}") < 1700
    assert s.get(key(1)) is not None
    s.flush()  # the renewal is written back in the background
    assert raw.pttl(f"kvboost:{NS}:{key(1)}") > 1700
    s.close()


def test_max_bytes_evicts_least_recently_used_and_keeps_pins(url):
    size = len(encode(chunk(seed=0), NS, key(0)))  # every test entry has this size
    s = RedisStore(url, namespace=NS, max_bytes=int(3.5 * size))
    s.put(key(0), chunk(seed=0), pin=True)
    s.put(key(1), chunk(seed=1))
    s.put(key(2), chunk(seed=2))
    s.flush()
    assert s.get(key(1)) is not None  # now key 2 is the least recently used
    s.flush()
    s.put(key(3), chunk(seed=3))
    s.flush()
    assert not s.contains(key(2))
    assert all(s.contains(key(i)) for i in (0, 1, 3))
    for i in range(4, 9):  # a run of new entries pushes out everything unpinned but the newest
        s.put(key(i), chunk(seed=i))
    s.flush()
    st = redis_stats(s)
    assert s.contains(key(0)), "pinned entries are never evicted"
    assert s.contains(key(8)) and not s.contains(key(1))
    assert st.bytes <= 3.5 * size and st.entries == 3 and st.evictions == 6
    s.close()


def test_pin_of_a_missing_key_is_false(store):
    assert store.pin(key(9)) is False


def test_remove_deletes_the_payload_and_its_records(store, raw):
    store.put(key(1), chunk(seed=1), pin=True)
    store.put(key(2), chunk(seed=2))
    store.flush()
    assert store.remove(key(1)) is True
    assert store.remove(key(1)) is False and store.remove(key(9)) is False
    assert not raw.exists(f"kvboost:{NS}:{key(1)}")
    s = redis_stats(store)
    assert (s.entries, s.pinned, s.bytes) == (1, 0, len(encode(chunk(seed=2), NS, key(2))))


def test_clear_empties_the_namespace_and_keeps_registry_records_and_other_namespaces(url):
    ns = "model[a]*?|tok"  # glob characters in a namespace are taken literally
    a = RedisStore(url, namespace=ns, background_writes=False)
    lookalike = RedisStore(
        url, namespace="modelaXY|tok", background_writes=False
    )  # what the raw glob matches
    other = RedisStore(url, namespace="model-b", background_writes=False)
    for s in (a, lookalike, other):
        s.put(key(1), chunk(seed=1), pin=True)
    records = a.shared_records()
    records.publish_documents([DOCUMENT])
    records.publish_sources({"content": Source(key(1), 0)})
    a.clear()
    assert not a.contains(key(1)) and a.get(key(1)) is None
    s = redis_stats(a)
    assert (s.entries, s.bytes, s.pinned, s.puts) == (0, 0, 0, 1)
    assert lookalike.contains(key(1)) and other.contains(key(1))
    assert a.sources(["content"]) == {"content": Source(key(1), 0)}  # the registry records stay
    assert a.shared_records().new_documents() == [DOCUMENT]
    a.put(key(2), chunk(seed=2))
    assert a.get(key(2)) is not None and redis_stats(a).entries == 1
    for s in (a, lookalike, other):
        s.close()


def test_a_redis_hit_keeps_its_cost_when_promoted_to_memory(store):
    store.put(key(1), chunk(seed=1), cost=77.0)
    store.flush()
    memory = MemoryStore(1 << 20)
    tiered = TieredStore([memory, store])
    hit = tiered.get(key(1))
    assert hit.tier == "redis" and hit.cost == 77.0
    assert memory.get(key(1)).cost == 77.0


def test_write_backs_are_callables(store, monkeypatch):
    """Every queued write (put, touch, registry records) is a zero-argument callable, not a tagged tuple."""
    queued = []
    submit = store._writer.submit
    monkeypatch.setattr(store._writer, "submit", lambda op, nbytes=0: queued.append(op) or submit(op, nbytes))
    store.put(key(1), chunk(seed=1))
    store.flush()
    store.get(key(1))
    records = store.shared_records()
    records.publish_documents([DOCUMENT])
    records.publish_sources({"content": Source(key(1), 0)})
    store.flush()
    assert len(queued) == 4 and all(callable(op) and not isinstance(op, tuple) for op in queued)
    assert records.new_documents() == [DOCUMENT]
    assert records.sources(["content"]) == {"content": Source(key(1), 0)}


def test_options_are_one_object_and_single_fields_override_it(url):
    options = RedisOptions(ttl_s=5.0, key_prefix="p", background_writes=False)
    s = RedisStore(url, namespace=NS, options=options, key_prefix="q")
    assert s.options == RedisOptions(ttl_s=5.0, key_prefix="q", background_writes=False)
    assert (s.ttl_s, s.key_prefix) == (5.0, "q")
    s.close()
    with pytest.raises(TypeError):
        RedisStore(url, namespace=NS, timeout=1)
    with pytest.raises(ValueError, match="ttl_s=0"):
        RedisOptions(ttl_s=0)
    with pytest.raises(ValueError, match="max_bytes=-1"):
        RedisStore(url, namespace=NS, max_bytes=-1)


# -- garbage and failures ------------------------------------------------------------------


def test_garbage_values_are_counted_misses_and_removed(store, raw, caplog):
    good = chunk(seed=1)
    store.put(key(1), good)
    store.flush()
    payload = raw.get(f"kvboost:{NS}:{key(1)}")
    raw.set(f"kvboost:{NS}:{key(2)}", b"garbage, not an entry")
    raw.set(f"kvboost:{NS}:{key(3)}", payload[: len(payload) // 2])  # truncated
    raw.set(f"kvboost:{NS}:{key(4)}", payload[:-1] + bytes([payload[-1] ^ 1]))  # one flipped bit
    raw.rpush(f"kvboost:{NS}:{key(5)}", b"a", b"list")  # a value of the wrong Redis type
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in (2, 3, 4, 5):
            assert store.get(key(i)) is None
    store.flush()
    s = redis_stats(store)
    assert s.extra["corrupt"] == 4 and s.extra["errors"] == 0 and s.misses == 4
    assert not any(raw.exists(f"kvboost:{NS}:{key(i)}") for i in (2, 3, 4, 5))
    assert "unusable" in caplog.text
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1, "warnings are rate-limited"
    assert_same_chunk(store.get(key(1)).chunk, good)  # untouched, and Redis was not written off


def test_a_hung_server_is_a_miss_within_the_timeout(blackhole, caplog):
    s = RedisStore(blackhole, namespace=NS, **FAST)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        hit, took = timed(s.get, key(1))
    assert hit is None and took < FAST["timeout_s"] + SLACK_S
    assert "failed" in caplog.text and "TimeoutError" in caplog.text
    # Backing off: the next calls do not wait on the server at all.
    _, took = timed(s.get, key(2))
    assert took < 0.05
    _, took = timed(s.contains, key(2))
    assert took < 0.05
    s.put(key(1), chunk())
    _, took = timed(s.flush)
    assert took < FAST["timeout_s"] + SLACK_S
    st = redis_stats(s)
    assert st.extra["errors"] >= 1 and st.extra["skipped"] >= 2
    _, took = timed(s.close)
    assert took < 2 * FAST["timeout_s"] + SLACK_S


def test_a_server_that_is_down_costs_nothing_after_the_first_try():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    s = RedisStore(url, namespace=NS, **FAST)
    for i in range(50):
        assert s.get(key(i)) is None
    st = redis_stats(s)
    assert st.misses == 50 and st.extra["errors"] == 1 and st.extra["skipped"] >= 49
    s.close()


def test_the_store_recovers_after_the_back_off(start_redis, redis_binary, tmp_path):
    server = start_redis()
    s = RedisStore(server.url, namespace=NS, **FAST)
    s.put(key(1), chunk(seed=1))
    s.flush()
    server.kill()
    assert s.get(key(1)) is None
    assert not s.available
    server.start()  # same port, empty
    time.sleep(FAST["backoff_s"] + 0.05)
    assert s.available and s.get(key(1)) is None
    s.put(key(1), chunk(seed=1))
    s.flush()
    assert s.get(key(1)) is not None
    s.close()


def test_a_full_write_queue_drops_writes_instead_of_blocking(blackhole, caplog):
    s = RedisStore(blackhole, namespace=NS, max_pending_writes=1, **(FAST | {"timeout_s": 0.5}))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t0 = time.perf_counter()
        for i in range(5):  # the writer hangs on the first; one waits in the queue; the rest are dropped
            s.put(key(i), chunk(seed=i))
        assert time.perf_counter() - t0 < 0.2
    assert "queue is full" in caplog.text
    assert s.stats()["redis"].extra["dropped_writes"] >= 3
    s.close()


def test_pending_bytes_are_bounded(blackhole):
    one = chunk(seed=1).nbytes
    s = RedisStore(blackhole, namespace=NS, max_pending_bytes=2 * one, **(FAST | {"timeout_s": 0.5}))
    for i in range(6):
        s.put(key(i), chunk(seed=i))
    assert s.stats()["redis"].extra["dropped_writes"] >= 3
    s.close()


def test_password_from_the_url_or_an_argument(start_redis):
    server = start_redis("--requirepass", "s3cret")
    by_arg = RedisStore(server.url, namespace=NS, password="s3cret", background_writes=False)
    by_arg.put(key(1), chunk(seed=1))
    in_url = RedisStore(f"redis://:s3cret@127.0.0.1:{server.port}/0", namespace=NS)
    assert in_url.get(key(1)) is not None
    wrong = RedisStore(server.url, namespace=NS, **FAST)
    assert wrong.get(key(1)) is None and redis_stats(wrong).extra["errors"] == 1
    for s in (by_arg, in_url, wrong):
        s.close()
    assert "s3cret" not in in_url.server


def test_tls_settings_pass_through_and_need_rediss():
    s = RedisStore(
        "rediss://cache.example:6380/2",
        namespace=NS,
        ssl_ca_certs="/ca.pem",
        client_options={"ssl_cert_reqs": "none"},
        background_writes=False,
    )
    kw = s._client.get_connection_kwargs()
    assert kw["ssl_ca_certs"] == "/ca.pem" and kw["ssl_cert_reqs"] == "none"
    assert kw["socket_connect_timeout"] == 0.5 and kw["socket_timeout"] == 2.0
    assert s.server == "cache.example:6380/2"
    s.close()
    with pytest.raises(ValueError, match="rediss://"):
        RedisStore("redis://cache.example", namespace=NS, ssl_certfile="/c.pem")
    with pytest.raises(ValueError, match="url or a client"):
        RedisStore(namespace=NS)


def test_an_existing_client(url):
    client = redis.Redis.from_url(url)
    s = RedisStore(client=client, namespace=NS, background_writes=False)
    s.put(key(1), chunk(seed=1))
    assert s.get(key(1)) is not None
    s.close()
    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(client=redis.Redis.from_url(url, decode_responses=True), namespace=NS)


# -- engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def engine_with(tiny, **config) -> KVBoostEngine:
    model, tok = tiny
    return KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16, **config))


def same_answer(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)


def test_config_wiring(tiny, url, tmp_path):
    cfg = EngineConfig(redis_url="redis://:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in repr(cfg)
    with engine_with(
        tiny, redis_url=url, redis_ttl_s=60, max_redis_bytes=1 << 20, redis_key_prefix="x", redis_options=FAST
    ) as engine:
        names = [t.name for t in engine.store.tiers]
        assert names == ["memory", "redis"]
        red = engine.store.tiers[-1]
        assert (red.ttl_s, red.max_bytes, red.key_prefix) == (60, 1 << 20, "x")
        assert red.namespace == engine.namespace
    model, tok = tiny
    with KVBoostEngine(model, tok, config=EngineConfig(redis_url=url), store_dir=tmp_path / "s") as engine:
        assert [t.name for t in engine.store.tiers] == ["memory", "disk", "redis"]
    with pytest.raises(ValueError, match="unknown option"):
        engine_with(tiny, redis_url=url, redis_options={"timeout": 1})


def test_answers_stay_exact_when_redis_dies_mid_run(tiny, server, caplog, monkeypatch):
    prompt = [PREFIX, Segment(DOCUMENT, "document"), QUESTION]
    other = [PREFIX, Segment(OTHER_DOCUMENT, "document"), QUESTION]
    gen = {"max_new_tokens": 6, "return_logits": True}
    reference = engine_with(tiny)
    ref = reference.generate(prompt, reuse="off", **gen)
    ref_other = reference.generate(other, reuse="off", **gen)
    cfg = {"redis_url": server.url, "redis_options": FAST}

    with engine_with(tiny, **cfg) as writer:
        assert writer.generate(prompt, **gen).usage.stored_tokens > 0
    reader = engine_with(tiny, **cfg)  # fresh memory: everything comes from Redis
    warm = reader.generate(prompt, **gen)
    assert warm.usage.cached_tokens_by_tier == {"redis": warm.usage.prompt_tokens}
    assert same_answer(warm, ref)

    server.kill()
    fresh = engine_with(tiny, **cfg)
    calls: list[float] = []
    for engine in (reader, fresh):
        tier = engine.store.tiers[-1]
        for name in ("get", "contains"):
            original = getattr(tier, name)

            def timed_call(*args, _original=original, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    calls.append(time.perf_counter() - t0)

            monkeypatch.setattr(tier, name, timed_call)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cold = fresh.generate(prompt, **gen)  # Redis is gone: misses, the uncached path
        new = reader.generate(other, **gen)
    assert cold.usage.cached_tokens == 0 and same_answer(cold, ref)
    assert "redis" not in new.usage.cached_tokens_by_tier  # only the shared prefix, from memory
    assert same_answer(new, ref_other)
    assert calls and max(calls) < FAST["connect_timeout_s"] + SLACK_S
    assert "redis tier" in caplog.text and "failed" in caplog.text
    for engine in (reader, fresh):
        assert engine.stats()["redis"]["extra"]["errors"] >= 1
        _, took = timed(engine.close)
        assert took < FAST["timeout_s"] + SLACK_S


def test_a_hung_server_leaves_answers_exact(tiny, blackhole):
    prompt = [PREFIX, Segment(DOCUMENT, "document"), QUESTION]
    ref = engine_with(tiny).generate(prompt, reuse="off", max_new_tokens=6, return_logits=True)
    with engine_with(tiny, redis_url=blackhole, redis_options=FAST) as engine:
        r, took = timed(lambda: engine.generate(prompt, max_new_tokens=6, return_logits=True))
        assert same_answer(r, ref) and r.usage.cached_tokens == 0
        assert took < FAST["timeout_s"] + 5.0  # one timeout, then back-off: not one timeout per chunk


def test_registry_records_are_shared_through_redis(tiny, url):
    a = engine_with(tiny, redis_url=url)
    a.prewarm([DOCUMENT], prefix=PREFIX)
    a.flush()
    b = engine_with(tiny, redis_url=url)  # no store directory: only Redis in common
    assert len(b.registry) == 1  # the document a registered
    r = b.generate(PREFIX + DOCUMENT + QUESTION, max_new_tokens=4)
    assert r.usage.cached_tokens_by_tier.get("redis", 0) >= len(b.canonicalize(PREFIX + DOCUMENT)) - 16
    a.close()
    b.close()


# -- two processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_a_document_prewarmed_by_one_process_is_a_full_hit_in_another(model_dir, url, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "doc.txt").write_text(DOCUMENT)
    cmd = [sys.executable, "-m", "kvboost_rag.cli", "prewarm", str(folder), "--model", str(model_dir)]
    cmd += ["--dtype", "float32", "--chunk-size", "16", "--store", str(tmp_path / "private-disk")]
    cmd += ["--prefix", PREFIX, "--redis-url", url, "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "prewarmed 1 documents" in done.stdout

    # This process: fresh memory, no store directory, only the Redis server in common.
    engine = KVBoostEngine.from_pretrained(str(model_dir), dtype="float32", chunk_size=16, redis_url=url)
    doc_tokens = len(engine.canonicalize(PREFIX + DOCUMENT))
    gen = {"max_new_tokens": 8, "return_logits": True}
    reference = engine.generate(PREFIX + DOCUMENT + QUESTION, reuse="off", **gen)

    flat = engine.generate(PREFIX + DOCUMENT + QUESTION, **gen)
    assert doc_tokens - 16 <= flat.usage.cached_tokens <= doc_tokens
    assert flat.usage.cached_tokens_by_tier == {"redis": flat.usage.cached_tokens}
    assert same_answer(flat, reference)
    engine.close()


def test_framework_adapters_pass_the_redis_url_and_hide_it(monkeypatch):
    """ChatKVBoost and KVBoost open their shared engine with the Redis tier; a password never shows."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from llama_index.llms.kvboost import KVBoost

    from kvboost_rag import shared
    from langchain_kvboost import ChatKVBoost

    seen = []
    monkeypatch.setattr(shared, "shared_engine", lambda spec: seen.append(spec))
    secret = "redis://:hunter2@127.0.0.1:6390/0"
    for llm in (ChatKVBoost(redis_url=secret), KVBoost(redis_url=secret)):
        llm.engine  # noqa: B018  (the property opens the engine)
        assert "hunter2" not in repr(llm)
    assert [spec.redis_url for spec in seen] == [secret, secret]


def test_tenant_salts_hold_through_redis(tiny, url):
    prompt = [PREFIX, Segment(DOCUMENT, "document"), QUESTION]
    cfg = {"redis_url": url, "redis_options": FAST}
    with engine_with(tiny, **cfg) as writer:
        writer.generate(prompt, max_new_tokens=2, cache_salt="tenant-a")
    with engine_with(tiny, **cfg) as reader:  # another worker: only Redis has the KV
        assert reader.generate(prompt, max_new_tokens=2, cache_salt="tenant-b").usage.cached_tokens == 0
        hit = reader.generate(prompt, max_new_tokens=2, cache_salt="tenant-a").usage
        assert hit.cached_tokens_by_tier == {"redis": hit.prompt_tokens}


def test_a_signed_redis_tier_never_serves_an_entry_forged_with_a_valid_checksum(url, raw):
    secret = b"the store secret, 32 bytes long."
    s = RedisStore(url, namespace="ns", background_writes=False, secret=secret)
    real = chunk(seed=3)
    s.put(key(1), real)
    assert raw.get(f"kvboost:ns:{key(1)}")[:4] == b"KVS2"
    assert torch.equal(s.get(key(1)).chunk.kv, real.kv)
    # any client of the server can write an entry whose checksum holds
    raw.set(f"kvboost:ns:{key(1)}", encode(StoredChunk(torch.zeros_like(real.kv)), "ns", key(1)))
    assert s.get(key(1)) is None and redis_stats(s).extra["foreign"] == 1
    assert redis_stats(s).extra["corrupt"] == 0
    s.close()


def test_under_mixed_secrets_redis_readers_miss_each_others_entries_and_remove_none(url, raw):
    secret_a, secret_b = b"the store secret, 32 bytes long.", b"another secret, 32 bytes long.."
    a = RedisStore(url, namespace="ns", background_writes=False, secret=secret_a)
    b = RedisStore(url, namespace="ns", background_writes=False, secret=secret_b)
    plain = RedisStore(url, namespace="ns", background_writes=False)
    a.put(key(1), chunk(seed=1))
    for reader in (b, plain):
        assert reader.get(key(1)) is None
        reader.put(key(1), chunk(seed=2))  # not written over the entry it could not read
        assert redis_stats(reader).extra["foreign"] == 1 and redis_stats(reader).extra["corrupt"] == 0
    assert torch.equal(a.get(key(1)).chunk.kv, chunk(seed=1).kv)
    plain.put(key(2), chunk(seed=4))
    assert a.get(key(2)) is None and raw.exists(f"kvboost:ns:{key(2)}")  # unsigned: a miss, kept
    rotating = RedisStore(url, namespace="ns", background_writes=False, secret=[secret_b, secret_a])
    assert rotating.get(key(1)) is not None  # the old secret still verifies during a rotation
    for s in (a, b, plain, rotating):
        s.close()
