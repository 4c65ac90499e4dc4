"""Batched generation and the scheduler: lone-run agreement, shared prefixes, isolation, cancellation.

Tolerance: in a batch the last chunk and the decode steps run as ``[rows, ...]``
matrices, whose float rounding differs from a lone run's ``[1, ...]`` ones, so
logits are compared within 1e-4 (float32) and greedy tokens must be equal.
The prefix KV is read or computed over the canonical schedule, so it is exact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch
from helpers import essay_paragraphs, record_admissions, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, InvalidRequestError, KVBoostEngine, Request, Segment
from kvboost_rag import batch as batch_module
from kvboost_rag.batch import RunningBatch

SHARED = Segment("A key-value cache stores attention keys and values for every token of the prompt. " * 3)
QUESTIONS = [
    "Why?",
    "What does it store for each token?",
    "Name one",
    "Is it exact, and how would we know that?",
]


def prompts() -> list[list[Segment]]:
    return [[SHARED, Segment(q)] for q in QUESTIONS]


def make_engine(arch: str = "llama", **config) -> KVBoostEngine:
    return KVBoostEngine(tiny_model(arch), tiny_tokenizer(), config=EngineConfig(chunk_size=16, **config))


def assert_matches_lone(batch, lone) -> None:
    for b, s in zip(batch, lone, strict=True):
        assert b.token_ids == s.token_ids
        assert b.text == s.text and b.finish_reason == s.finish_reason
        torch.testing.assert_close(b.first_logits, s.first_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
def test_batch_tokens_equal_lone_runs(arch):
    engine = make_engine(arch)
    lone = [engine.generate(p, max_new_tokens=12, return_logits=True) for p in prompts()]
    fresh = make_engine(arch)  # nothing stored: the batch computes the shared prefix itself
    batch = fresh.generate_batch(prompts(), max_new_tokens=12, return_logits=True)
    assert_matches_lone(batch, lone)


@pytest.mark.parametrize("transposed", [True, False])
def test_batched_steps_use_transposed_weights_only_inside_the_batch(transposed):
    engine = make_engine(batch_transposed_weights=transposed)
    lone = [engine.generate(p, max_new_tokens=8, return_logits=True) for p in prompts()]
    # lone requests copy nothing (their decode steps run the split-invariant forward)
    assert list(engine.assembler._transposed) == []
    batch = engine.generate_batch(prompts(), max_new_tokens=8, return_logits=True)
    assert_matches_lone(batch, lone)
    linear_count = sum(type(m) is torch.nn.Linear for m in engine.model.modules())
    assert len(engine.assembler._transposed) == (linear_count if transposed else 0)
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" not in vars(m) for m in linears)  # the model is left as it was
    again = engine.generate(prompts()[0], max_new_tokens=8, return_logits=True)
    assert again.token_ids == lone[0].token_ids and torch.equal(again.first_logits, lone[0].first_logits)


def test_rows_with_different_prefixes_and_lengths_get_their_own_positions():
    engine = make_engine()
    other = Segment("Tokens are the unit of text a language model reads and writes, one id each. " * 2)
    mixed = [
        [SHARED, Segment("Why?")],
        [other, Segment("How many ids?")],
        ["Short one."],
        [SHARED, other, "Both?"],
    ]
    lone = [engine.generate(p, max_new_tokens=10, return_logits=True) for p in mixed]
    batch = make_engine().generate_batch(mixed, max_new_tokens=10, return_logits=True)
    assert_matches_lone(batch, lone)


def test_rows_finish_independently_with_their_own_sampling_and_stops():
    engine = make_engine()
    free = engine.generate(prompts()[0], max_new_tokens=20)
    stop = free.text[3:5]
    requests = [
        Request(prompts()[0], max_new_tokens=20, stop=[stop]),
        Request(prompts()[1], max_new_tokens=3),
        Request(prompts()[2], max_new_tokens=25),
        Request(prompts()[3], max_new_tokens=8, temperature=0.8, seed=7),
    ]
    lone = [engine.generate(**vars(r)) for r in requests[:3]]
    batch = make_engine().generate_batch(requests)
    assert [b.token_ids for b in batch[:3]] == [s.token_ids for s in lone]
    assert batch[0].finish_reason == "stop" and batch[0].text == free.text[: free.text.find(stop)]
    assert len(batch[1].token_ids) == 3 and batch[1].finish_reason == "length"
    again = make_engine().generate_batch(requests)
    assert again[3].token_ids == batch[3].token_ids  # a seeded sampled row is reproducible


def test_shared_prefix_is_computed_once_and_accounting_adds_up():
    engine = make_engine()
    batch = engine.generate_batch(prompts(), max_new_tokens=4)
    # its own chunks, the last one short
    shared = len(engine.canonicalize([SHARED], add_generation_prompt=False))
    # the first row had to compute the shared prefix, so it prefilled as a lone request does (storing its
    # whole prompt); the others read the prefix and run only their last chunks, together
    assert (
        batch[0].usage.stored_tokens
        == make_engine().generate(prompts()[0], max_new_tokens=1).usage.stored_tokens
    )
    assert batch[0].usage.stored_tokens >= shared
    assert [r.usage.recomputed_tokens for r in batch[1:]] == [
        r.usage.prompt_tokens - shared for r in batch[1:]
    ]
    assert [r.usage.cached_tokens for r in batch[1:]] == [shared] * 3
    for r in batch:
        u = r.usage
        assert u.cached_tokens + u.recomputed_tokens == u.prompt_tokens
        assert 0 < r.timings.ttft_s <= r.timings.total_s
    off = make_engine().generate_batch(prompts(), max_new_tokens=4, reuse="off")
    assert all(r.usage.cached_tokens == 0 and r.usage.stored_tokens == 0 for r in off)
    assert [r.token_ids for r in off] == [r.token_ids for r in batch]


def test_a_prefix_every_row_shares_is_kept_once(monkeypatch):
    from kvboost_rag import chunk_attention

    seen: list[int] = []
    real = chunk_attention.shared_prefix

    def spy(layers):
        seen.append(layers[0][0].shape[2])  # [1, kv_heads, tokens, head_dim]
        return real(layers)

    monkeypatch.setattr(chunk_attention, "shared_prefix", spy)
    engine = make_engine()
    lone = [engine.generate(p, max_new_tokens=6, return_logits=True) for p in prompts()]
    batch = engine.generate_batch(prompts(), max_new_tokens=6, return_logits=True)
    shared = len(engine.canonicalize([SHARED], add_generation_prompt=False))
    assert seen and set(seen) == {shared}  # the prefill and every decode step attend to one copy
    assert_matches_lone(batch, lone)


def test_a_bad_request_fails_alone():
    engine = make_engine()
    results = engine.generate_batch(
        [prompts()[0], "", prompts()[1]], max_new_tokens=4, return_exceptions=True
    )
    assert isinstance(results[1], InvalidRequestError)
    assert results[0].token_ids == engine.generate(prompts()[0], max_new_tokens=4).token_ids
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate_batch([prompts()[0], ""], max_new_tokens=4)
    futures = [engine.submit(Request(p, max_new_tokens=4)) for p in (prompts()[0], "", prompts()[2])]
    with pytest.raises(InvalidRequestError):
        futures[1].result()
    assert futures[0].result().token_ids == results[0].token_ids
    assert futures[2].result().finish_reason in ("stop", "length")


def test_extreme_sampling_settings_in_a_batch_do_not_fail_it():
    # Once, temperature 1e-300 or top_p 1e-300 made the sampler's probabilities NaN, and the error
    # failed every request of the batch; now such a request samples (like greedy) beside the others.
    engine = make_engine()
    lone = [engine.generate(p, max_new_tokens=4) for p in prompts()]
    extreme = [
        Request(prompts()[0], max_new_tokens=4),
        Request(prompts()[1], max_new_tokens=4, temperature=1e-300, seed=1),
        Request(prompts()[2], max_new_tokens=4, temperature=1.0, top_p=1e-300, seed=2),
        Request(prompts()[3], max_new_tokens=4),
    ]
    results = engine.generate_batch(extreme, return_exceptions=True)
    assert [r.token_ids for r in results] == [r.token_ids for r in lone]  # the extremes act greedily


@pytest.mark.parametrize("stage", ["prefill", "sampling"])
def test_a_request_failing_inside_the_batch_fails_alone(monkeypatch, stage):
    engine = make_engine()
    lone = [engine.generate(p, max_new_tokens=5) for p in prompts()]
    engine = make_engine()
    batch = prompts()
    poisoned = batch[1]
    if stage == "prefill":
        real_row = engine.generation._batch_row

        def row(p, chunks, *hooks):
            if p.request.prompt is poisoned:
                raise MemoryError("no room for this prefix")
            return real_row(p, chunks, *hooks)

        monkeypatch.setattr(engine.generation, "_batch_row", row)
    else:
        real_select = batch_module.select_token

        def select(logits, request, generator):
            if request.prompt is poisoned:
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
            return real_select(logits, request, generator)

        monkeypatch.setattr(batch_module, "select_token", select)
    results = engine.generate_batch(batch, max_new_tokens=5, return_exceptions=True)
    assert isinstance(results[1], MemoryError if stage == "prefill" else RuntimeError)
    for i in (0, 2, 3):
        assert results[i].token_ids == lone[i].token_ids


def test_scheduler_merges_concurrent_callers(monkeypatch):
    sizes = record_admissions(monkeypatch)
    engine = make_engine(batch_window_ms=300)
    lone = [make_engine().generate(p, max_new_tokens=6) for p in prompts()]
    results: list = [None] * 4

    def call(i: int) -> None:
        results[i] = engine.generate(prompts()[i], max_new_tokens=6)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sizes == [4]
    assert [r.token_ids for r in results] == [r.token_ids for r in lone]
    engine.close()


def test_cancelling_a_running_request_leaves_the_others_intact():
    engine = make_engine(batch_window_ms=200)
    # Never-ending rows: the tiny model rarely emits EOS within this budget.
    long_a = engine.submit(Request(prompts()[0], max_new_tokens=400))
    long_b = engine.submit(Request(prompts()[1], max_new_tokens=400))
    queued = engine.submit(Request(prompts()[2], max_new_tokens=5))
    deadline = time.monotonic() + 30
    while not long_a.running() and time.monotonic() < deadline:
        time.sleep(0.005)
    long_a.cancel()
    with pytest.raises(CancelledError):
        long_a.result(timeout=60)
    b = long_b.result(timeout=120)
    assert b.token_ids == make_engine().generate(prompts()[1], max_new_tokens=400).token_ids
    assert queued.result(timeout=60).usage.completion_tokens <= 5
    engine.close()


def test_asyncio_callers_are_batched_and_a_timeout_cancels_only_its_request():
    engine = make_engine(batch_window_ms=50)
    lone = [make_engine().generate(p, max_new_tokens=6) for p in prompts()]

    async def main():
        answers = await asyncio.gather(*(engine.agenerate(p, max_new_tokens=6) for p in prompts()))
        slow = asyncio.create_task(asyncio.wait_for(engine.agenerate(prompts()[0], max_new_tokens=400), 0.05))
        fine = asyncio.create_task(engine.agenerate(prompts()[1], max_new_tokens=6))
        with pytest.raises(asyncio.TimeoutError):
            await slow
        return answers, await fine

    answers, fine = asyncio.run(main())
    assert [a.token_ids for a in answers] == [r.token_ids for r in lone]
    assert fine.token_ids == lone[1].token_ids
    engine.close()


def test_max_batch_size_one_runs_every_request_alone(monkeypatch):
    monkeypatch.setattr(RunningBatch, "admit", lambda *a: pytest.fail("batched although disabled"))
    engine = make_engine(max_batch_size=1)
    assert engine.generate(prompts()[0], max_new_tokens=3).usage.completion_tokens <= 3


@pytest.mark.real_model
def test_smollm2_rag_batch_matches_lone_greedy_answers(smollm2):
    model, tokenizer = smollm2
    docs = essay_paragraphs(3, max_chars=700)
    questions = [
        "What is the main point?",
        "Who is the author addressing?",
        "Give one example from the text.",
    ]
    messages = [
        [
            {"role": "system", "content": "Answer from the context."},
            {
                "role": "user",
                "content": [*({"type": "text", "text": d} for d in docs), {"type": "text", "text": q}],
            },
        ]
        for q in questions
    ]
    lone_engine = KVBoostEngine(model, tokenizer, config=EngineConfig(max_batch_size=1))
    lone = [lone_engine.generate(m, max_new_tokens=16, return_logits=True) for m in messages]
    batch = KVBoostEngine(model, tokenizer).generate_batch(messages, max_new_tokens=16, return_logits=True)
    assert_matches_lone(batch, lone)
    assert all(r.usage.cached_tokens > 0 for r in batch[1:])
