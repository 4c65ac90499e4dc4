"""Redis tier on a local 3-primary Redis Cluster: entries spread over the nodes in hash-tagged
shards, scripts stay in one slot, eviction and pins hold per shard, and a node that restarts
costs misses while it is away, never a wrong entry.

The cluster is started from the system's ``redis-server`` and ``redis-cli`` (``make test``
installs them when it can), once for the module; every test uses a namespace of its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

import pytest
import torch
from helpers import assert_same_chunk, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine
from kvboost_rag.canonical import Segment
from kvboost_rag.registry import Source
from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.serialization import encode

redis = pytest.importorskip("redis")
from redis.cluster import RedisCluster  # noqa: E402  (after the skip when redis-py is absent)
from redis.crc import key_slot  # noqa: E402
from redis_servers import LocalCluster, RedisServer  # noqa: E402

from kvboost_rag.store.redis import RedisStore  # noqa: E402
from kvboost_rag.store.redis_scripts import NamespaceKeys  # noqa: E402

LOGGER = "kvboost_rag.store.redis"
FAST = {"connect_timeout_s": 0.3, "timeout_s": 0.5, "backoff_s": 0.3, "cluster": True}
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def cluster(redis_binary, tmp_path_factory) -> Iterator[LocalCluster]:
    c = LocalCluster(redis_binary, tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture
def ns() -> str:
    return f"model-{next(_namespaces)}|tok|float32|v1"


@pytest.fixture
def raw(cluster) -> Iterator[RedisCluster]:
    client = RedisCluster.from_url(cluster.url)
    yield client
    client.close()


def key(i: int) -> str:
    return f"{i:04x}".ljust(64, "0")


def chunk(seed: int, tokens: int = 4) -> StoredChunk:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, 2, tokens, 16, generator=g)
    return StoredChunk(kv, token_ids=tuple(range(seed, seed + tokens)), parent_key=key(seed + 1000))


def open_store(cluster: LocalCluster, ns: str, **settings) -> RedisStore:
    return RedisStore(cluster.url, namespace=ns, background_writes=False, **{**FAST, **settings})


def node_of(raw: RedisCluster, redis_key: str) -> str:
    return raw.get_node_from_key(redis_key).name


def test_entries_round_trip_and_spread_over_every_primary(cluster, ns, raw):
    s = open_store(cluster, ns)
    stored = {i: chunk(i) for i in range(48)}
    for i, c in stored.items():
        s.put(key(i), c)
    for i, c in stored.items():
        assert_same_chunk(s.get(key(i)).chunk, c)
    keys = NamespaceKeys("kvboost", ns, shards=16)
    assert {node_of(raw, keys.entry(key(i))) for i in stored} == {
        f"127.0.0.1:{n.port}" for n in cluster.nodes
    }
    st = s.stats()["redis"]
    assert st.entries == 48 and st.extra["errors"] == 0
    assert st.bytes == sum(len(encode(c, ns, key(i))) for i, c in stored.items())
    s.close()


def test_every_script_touches_one_slot(cluster, ns):
    """A script over keys of several slots fails on a cluster (CROSSSLOT); each shard is one slot."""
    keys = NamespaceKeys("kvboost", ns, shards=16)
    for shard in keys.shards:
        records = shard.entry_records(key(1))
        assert len({key_slot(k.encode()) for k in records}) == 1
    assert len({key_slot(k.encode()) for k in (keys.docs, keys.doc_ids)}) == 1
    assert len({key_slot(s.base.encode()) for s in keys.shards}) == 16


def test_eviction_stays_within_the_budget_and_keeps_pins(cluster, ns):
    size = len(encode(chunk(10), ns, key(10)))  # every entry here has about this size
    shards = 4
    s = open_store(cluster, ns, cluster_shards=shards, max_bytes=shards * 2 * size)  # 2 entries a shard
    pinned = [i for i in range(40) if i % 10 == 0]
    for i in range(40):
        s.put(key(i), chunk(i), pin=i in pinned)
    st = s.stats()["redis"]
    assert all(s.contains(key(i)) for i in pinned), "pinned entries are never evicted"
    unpinned_left = [i for i in range(40) if i not in pinned and s.contains(key(i))]
    assert st.evictions == 40 - len(pinned) - len(unpinned_left)
    assert st.entries == len(pinned) + len(unpinned_left) and st.pinned == len(pinned)
    assert st.bytes == sum(len(encode(chunk(i), ns, key(i))) for i in pinned + unpinned_left)
    # a shard keeps its two most recent unpinned entries, or fewer when pins take its room
    keys = NamespaceKeys("kvboost", ns, shards=shards)
    for shard in keys.shards:
        mine = [i for i in range(40) if keys.shard(key(i)) is shard]
        room = max(0, 2 - len([i for i in mine if i in pinned]))
        newest = [i for i in mine if i not in pinned][-room:] if room else []
        assert [i for i in mine if i in unpinned_left] == newest
    s.close()


def test_pin_remove_and_clear_across_the_nodes(cluster, ns, raw):
    s = open_store(cluster, ns)
    for i in range(24):
        s.put(key(i), chunk(i))
    assert s.pin(key(3)) and not s.pin(key(99))
    assert s.remove(key(4)) and not s.remove(key(4))
    records = s.shared_records()
    records.publish_documents(["a document long enough to be an anchor for the registry " * 2])
    records.publish_sources({"content": Source(key(1), 0)})
    s.flush()
    st = s.stats()["redis"]
    assert (st.entries, st.pinned) == (23, 1)
    other = open_store(cluster, ns + "-other")
    other.put(key(1), chunk(1))
    s.clear()
    assert not any(s.contains(key(i)) for i in range(24))
    assert s.stats()["redis"].entries == 0
    assert records.sources(["content"]) == {"content": Source(key(1), 0)}, "the registry records stay"
    assert len(open_store(cluster, ns).shared_records().new_documents()) == 1
    assert other.contains(key(1)), "another namespace is untouched"
    for store in (s, other):
        store.close()


def test_a_standalone_client_on_a_cluster_says_how_to_fix_it(cluster, ns, caplog):
    s = RedisStore(cluster.url, namespace=ns, background_writes=False, **{**FAST, "cluster": False})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(8):  # some keys hash to the node the URL names, the others are MOVED
            s._breaker.success()  # no back-off between the tries: each key is asked
            s.put(key(i), chunk(i))
    assert "set redis_options={'cluster': True}" in caplog.text
    s.close()


def test_a_node_restart_costs_misses_and_nothing_wrong(cluster, ns, raw, caplog):
    s = open_store(cluster, ns)
    stored = {i: chunk(i) for i in range(24)}
    for i, c in stored.items():
        s.put(key(i), c)
    keys = NamespaceKeys("kvboost", ns, shards=16)
    victim = cluster.nodes[1]
    on_victim = {i for i in stored if node_of(raw, keys.entry(key(i))) == f"127.0.0.1:{victim.port}"}
    assert on_victim and len(on_victim) < len(stored)

    victim.kill()
    cluster.wait_down()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t0 = time.monotonic()
        for i in stored:  # the cluster is down: every read is a miss, none is an error raised
            assert s.get(key(i)) is None
        s.put(key(100), chunk(100))  # dropped, not raised
        took_s = time.monotonic() - t0
    assert s.stats()["redis"].extra["errors"] >= 1 and "failed" in caplog.text
    assert took_s < 10.0, "the back-off keeps a down cluster from costing a timeout per call"

    victim.start()  # same port and folder: it rejoins with its slots, and without its data
    cluster.wait_ok()
    deadline = time.monotonic() + 15
    while s.get(key(next(iter(set(stored) - on_victim)))) is None:  # until the back-off ends
        assert time.monotonic() < deadline, "the store did not come back after the node did"
        time.sleep(0.1)
    for i, c in stored.items():
        hit = s.get(key(i))
        if i in on_victim:
            assert hit is None  # its data went with the node
        else:
            assert_same_chunk(hit.chunk, c)
    s.put(key(200), chunk(200))
    assert_same_chunk(s.get(key(200)).chunk, chunk(200))
    s.close()


def test_a_store_pointed_at_a_cluster_that_is_not_up_is_a_quick_miss(redis_binary, tmp_path, ns):
    node = RedisServer(redis_binary, tmp_path)  # nothing started on its port
    s = RedisStore(node.url, namespace=ns, **FAST)  # makes no connection yet
    assert s.get(key(1)) is None and s.stats()["redis"].extra["errors"] == 1
    s.close()


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def test_an_engine_shares_chunks_through_the_cluster(cluster, ns, tiny):
    model, tok = tiny
    prompt = [
        "Answer from the documents below.\n\n",
        Segment("The fox jumps over the dog. " * 12, "document"),
    ]
    prompt.append("\n\nQuestion: what is this about?")
    config = EngineConfig(chunk_size=16, redis_url=cluster.url, redis_options={**FAST, "key_prefix": ns})
    reference = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16))
    ref = reference.generate(prompt, reuse="off", max_new_tokens=6, return_logits=True)
    with KVBoostEngine(model, tok, config=config) as writer:
        assert writer.generate(prompt, max_new_tokens=6).usage.stored_tokens > 0
    with KVBoostEngine(model, tok, config=config) as reader:  # fresh memory: every chunk from the cluster
        warm = reader.generate(prompt, max_new_tokens=6, return_logits=True)
    assert warm.usage.cached_tokens_by_tier == {"redis": warm.usage.prompt_tokens}
    assert warm.token_ids == ref.token_ids and torch.equal(warm.first_logits, ref.first_logits)
