"""Contract 1 with a SentencePiece-style tokenizer (a ``▁`` word-start marker at every input start)."""

from __future__ import annotations

import torch
from helpers import sentencepiece_style_tokenizer, tiny_model

from kvboost_rag import EngineConfig, KVBoostEngine, Segment
from kvboost_rag.canonical import Canonicalizer

TEXTS = ["Hello ", "world", "\nThe quick brown fox", "  spaced  out ", "Ünïcödé 🙂 tabs\there"]


def test_naive_per_segment_tokenization_would_break_the_round_trip():
    tok = sentencepiece_style_tokenizer()
    ids = [i for t in TEXTS for i in tok.encode(t, add_special_tokens=False)]
    assert tok.decode(ids) != "".join(TEXTS)  # why the canonicalizer needs its anchor


def test_canonical_ids_round_trip_and_do_not_depend_on_neighbours():
    canon = Canonicalizer(sentencepiece_style_tokenizer())
    prompt = canon.canonicalize([Segment(t) for t in TEXTS])
    assert canon.decode(prompt.token_ids) == prompt.text == "".join(TEXTS)
    for i, text in enumerate(TEXTS):
        alone = canon.canonicalize([Segment(text)]).segment_token_ids[0]
        assert prompt.segment_token_ids[i] == alone


def test_exact_reuse_with_a_sentencepiece_style_tokenizer():
    model = tiny_model("llama", vocab_size=400)
    engine = KVBoostEngine(model, sentencepiece_style_tokenizer(), config=EngineConfig(chunk_size=8))
    prompt = [Segment(t) for t in TEXTS]
    cold = engine.generate(prompt, max_new_tokens=6, return_logits=True)
    warm = engine.generate(prompt, max_new_tokens=6, return_logits=True)
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens
    assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids
