"""Contract 3: no chunk is served across models, weights, dtypes, tokenizers, positions or prefixes."""

from __future__ import annotations

import torch
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Segment
from kvboost_rag.fingerprint import model_fingerprint, refresh_model_fingerprint, tokenizer_fingerprint
from kvboost_rag.store import MemoryStore

PROMPT = [Segment("The quick brown fox jumps over the lazy dog. " * 4), Segment("Why?")]


def shared_store_hits(first: KVBoostEngine, second: KVBoostEngine, prompt=PROMPT) -> int:
    first.generate(prompt, max_new_tokens=2)
    return second.generate(prompt, max_new_tokens=2).usage.cached_tokens


def engine(model, tok=None, store=None):
    return KVBoostEngine(model, tok or tiny_tokenizer(), config=EngineConfig(chunk_size=16), store=store)


def test_same_model_shares_the_store():
    store, model = MemoryStore(1 << 30), tiny_model("llama")
    assert shared_store_hits(engine(model, store=store), engine(model, store=store)) > 0


def test_another_dtype_misses():
    store = MemoryStore(1 << 30)
    fp32, bf16 = tiny_model("llama", torch.float32), tiny_model("llama", torch.bfloat16)
    assert shared_store_hits(engine(fp32, store=store), engine(bf16, store=store)) == 0


def test_another_model_misses():
    store = MemoryStore(1 << 30)
    assert (
        shared_store_hits(engine(tiny_model("llama"), store=store), engine(tiny_model("qwen2"), store=store))
        == 0
    )


def test_changed_weights_miss():
    store = MemoryStore(1 << 30)
    a, b = tiny_model("llama"), tiny_model("llama")
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        b.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # one weight, far from the inputs
    assert refresh_model_fingerprint(b) != model_fingerprint(a)
    assert shared_store_hits(engine(a, store=store), engine(b, store=store)) == 0


def test_another_tokenizer_misses():
    store, model = MemoryStore(1 << 30), tiny_model("llama")
    plain, with_bos = tiny_tokenizer(), tiny_tokenizer(add_bos=True)
    assert tokenizer_fingerprint(plain) != tokenizer_fingerprint(with_bos)
    assert shared_store_hits(engine(model, plain, store), engine(model, with_bos, store)) == 0


def test_same_document_at_another_position_or_after_another_prefix_misses():
    e = engine(tiny_model("llama"))
    doc = Segment("A key-value cache stores attention keys and values per token. " * 3, "document")
    first = [Segment("Intro one. "), doc, Segment("Q?")]
    e.generate(first, max_new_tokens=1)
    for intro in ("Intro two. ", "Intro one. Longer. "):
        prompt = [Segment(intro), doc, Segment("Q?")]
        ids, stored = e.canonicalize(prompt).token_ids, e.canonicalize(first).token_ids
        common = next(i for i, (a, b) in enumerate(zip(ids, stored, strict=False)) if a != b)
        assert common < len(e.canonicalize(intro).token_ids)  # the prompts part inside the intro
        # only the intro's shared leading tokens are read; the document after it is computed
        assert e.generate(prompt, max_new_tokens=1).usage.cached_tokens == common


def test_fingerprint_is_cached_and_fast_enough():
    model = tiny_model("llama")
    assert model_fingerprint(model) is model_fingerprint(model)
