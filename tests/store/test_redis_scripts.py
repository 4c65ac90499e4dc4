"""The Redis tier's key layout (the scripts themselves run against a real server in test_redis.py)."""

from __future__ import annotations

from kvboost_rag.store.redis_scripts import NamespaceKeys


def test_keys_of_a_namespace():
    keys = NamespaceKeys("deploy", "model|tok")
    assert keys.base == "deploy:model|tok:"
    assert keys.entry("ab") == "deploy:model|tok:ab"
    assert keys.entry_records("ab") == [
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


def test_bookkeeping_keys_cannot_be_entry_keys():
    """Prefix keys are hex digests; every bookkeeping key has a '#' where an entry's key starts."""
    keys = NamespaceKeys("kvboost", "ns")
    bookkeeping = [keys.sizes, keys.lru, keys.bytes, keys.pinned, *keys.registry]
    assert all(k.startswith(keys.base + "#") for k in bookkeeping)
    assert len(set(bookkeeping)) == len(bookkeeping)
