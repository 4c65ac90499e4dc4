"""Tenant isolation: a request's ``cache_salt`` partitions what it reads and writes, in every tier."""

from __future__ import annotations

import torch
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request, Segment

SYSTEM = Segment("You answer from the private notes below. " + " ".join(essay_paragraphs(2)))
PROMPT = [SYSTEM, Segment("What do the notes say first?")]
GEN = {"max_new_tokens": 5, "return_logits": True}


def make_engine(**kwargs) -> KVBoostEngine:
    return KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16), **kwargs)


def same_answer(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)


def test_tenants_never_read_each_others_kv():
    engine = make_engine()
    reference = make_engine().generate(PROMPT, reuse="off", **GEN)
    first = engine.generate(PROMPT, cache_salt="tenant-a", **GEN)
    assert first.usage.cached_tokens == 0 and first.usage.stored_tokens > 0
    other = engine.generate(PROMPT, cache_salt="tenant-b", **GEN)
    shared = engine.generate(PROMPT, **GEN)  # no salt: the shared store, which A's prompt never entered
    assert other.usage.cached_tokens == 0 and shared.usage.cached_tokens == 0
    again = engine.generate(PROMPT, cache_salt="tenant-a", **GEN)
    assert again.usage.cached_tokens == again.usage.prompt_tokens  # A's own hit, logits included
    for result in (first, other, shared, again):
        assert same_answer(result, reference)  # a salt changes keys, never bits


def test_salts_hold_in_the_disk_tier_of_a_later_engine(tmp_path):
    with make_engine(store_dir=tmp_path) as writer:
        writer.generate(PROMPT, cache_salt="tenant-a", **GEN)
    with make_engine(store_dir=tmp_path) as reader:  # fresh memory: only the disk tier remembers
        assert reader.generate(PROMPT, cache_salt="tenant-b", **GEN).usage.cached_tokens == 0
        hit = reader.generate(PROMPT, cache_salt="tenant-a", **GEN)
        assert hit.usage.cached_tokens_by_tier == {"disk": hit.usage.prompt_tokens}


def test_prewarmed_documents_serve_their_tenant_only():
    engine = make_engine()
    doc = essay_paragraphs(4)[3]
    engine.prewarm([doc], prefix=[SYSTEM], cache_salt="tenant-a")
    prompt = [SYSTEM, Segment(doc, "document"), Segment("Summarize it.")]
    assert engine.generate(prompt, cache_salt="tenant-b", **GEN).usage.cached_tokens == 0
    assert engine.generate(prompt, **GEN).usage.cached_tokens == 0
    assert engine.generate(prompt, cache_salt="tenant-a", **GEN).usage.cached_tokens > len(doc) // 8


def test_a_batch_shares_prefixes_within_a_tenant_only():
    engine = make_engine()
    engine.generate(PROMPT, cache_salt="tenant-a", **GEN)
    requests = [Request(PROMPT, cache_salt=salt, **GEN) for salt in ("tenant-a", "tenant-b", "tenant-a")]
    lone = make_engine().generate(PROMPT, reuse="off", **GEN)
    results = engine.generate_batch(requests)
    assert results[1].usage.cached_tokens == 0
    assert results[0].usage.cached_tokens > 0 and results[2].usage.cached_tokens > 0
    assert all(r.token_ids == lone.token_ids for r in results)


def test_a_chat_reply_is_stored_for_its_tenant():
    engine = make_engine()
    turn = [{"role": "system", "content": SYSTEM.text}, {"role": "user", "content": "Hello?"}]
    answer = engine.generate(turn, max_new_tokens=6, cache_salt="tenant-a")
    engine.flush()  # the reply is stored in the background
    follow = [*turn, {"role": "assistant", "content": answer.text}, {"role": "user", "content": "And?"}]
    mine = engine.generate(follow, max_new_tokens=2, cache_salt="tenant-a").usage
    theirs = engine.generate(follow, max_new_tokens=2, cache_salt="tenant-b").usage
    assert theirs.cached_tokens == 0 and mine.cached_tokens > len(engine.canonicalize(turn)) - 16
