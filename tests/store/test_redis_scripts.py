"""The Redis tier's key layout (the scripts themselves run against real servers in test_redis.py
and test_redis_cluster.py)."""

from __future__ import annotations

import pytest

from kvboost_rag.store.redis_scripts import NamespaceKeys


def test_keys_of_a_namespace_on_a_standalone_server():
    keys = NamespaceKeys("deploy", "model|tok")
    assert keys.entry("ab") == "deploy:model|tok:ab"
    assert keys.shard("ab").entry_records("ab") == [
        "deploy:model|tok:ab",
        "deploy:model|tok:#sizes",
        "deploy:model|tok:#lru",
        "deploy:model|tok:#bytes",
        "deploy:model|tok:#pinned",
    ]
    assert keys.registry == (
        "deploy:model|tok:#docs",
        "deploy:model|tok:#doc-ids",
        "deploy:model|tok:#sources",
    )
    assert keys.scan_pattern == "deploy:model|tok:*"


def test_cluster_shards_lead_with_their_hash_tag():
    keys = NamespaceKeys("deploy", "model{x}|tok", shards=8)
    bases = [s.base for s in keys.shards]
    assert len(set(bases)) == 8
    for base in bases:  # the tag is the first {...}: braces in the namespace cannot move it
        tag, rest = base[1:].split("}", 1)
        assert rest == "deploy:model{x}|tok:" and "{" not in tag
    assert {keys.shard(f"{i:064x}").base for i in range(200)} == set(bases)  # every shard gets entries
    assert keys.entry("ab") == keys.shard("ab").base + "ab"
    assert (
        keys.docs.endswith("deploy:model{x}|tok:#docs")
        and keys.docs.split("}")[0] == keys.doc_ids.split("}")[0]
    )
    assert NamespaceKeys("deploy", "other", shards=8).shards[0].base != bases[0]
    with pytest.raises(ValueError, match="at least one shard"):
        NamespaceKeys("deploy", "ns", shards=0)


@pytest.mark.parametrize("shards", [None, 4])
def test_bookkeeping_keys_cannot_be_entry_keys(shards):
    """Prefix keys are hex digests; every bookkeeping key has a '#' where an entry's key starts."""
    keys = NamespaceKeys("kvboost", "ns", shards=shards)
    bookkeeping = [k for s in keys.shards for k in (s.sizes, s.lru, s.bytes, s.pinned)] + list(keys.registry)
    assert all(k.split(":")[-1].startswith("#") for k in bookkeeping)
    assert len(set(bookkeeping)) == len(bookkeeping)
