"""Engine API: results, streaming, stop strings, threads, bad input (contract 8), model families."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import tiny_config, tiny_model, tiny_tokenizer

from kvboost_rag import (
    ContextWindowExceededError,
    EngineConfig,
    InvalidRequestError,
    KVBoostEngine,
    ModelNotFoundError,
    Segment,
    UnsupportedModelError,
)

PROMPT = [Segment("A key-value cache stores attention keys and values per token. " * 3), Segment("Why? ")]


@pytest.fixture
def engine():
    return KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16))


def test_result_fields_add_up(engine):
    r = engine.generate(PROMPT, max_new_tokens=5)
    u = r.usage
    assert u.prompt_tokens == len(engine.canonicalize(PROMPT))
    assert u.cached_tokens + u.recomputed_tokens + u.approx_tokens == u.prompt_tokens
    assert u.completion_tokens == len(r.token_ids) <= 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert r.finish_reason in ("stop", "length")
    assert 0 < r.timings.ttft_s <= r.timings.total_s
    assert r.first_logits is None


def test_stream_deltas_join_to_the_result_text(engine):
    chunks = list(engine.stream(PROMPT, max_new_tokens=20))
    assert chunks[-1].result is not None and all(c.result is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == chunks[-1].result.text
    assert chunks[-1].result.text == engine.generate(PROMPT, max_new_tokens=20).text


def test_stop_string_is_trimmed_and_reported(engine):
    free = engine.generate(PROMPT, max_new_tokens=20)
    assert len(free.text) > 3, "the tiny model should produce some text"
    stop = free.text[2:4]
    stopped = engine.generate(PROMPT, max_new_tokens=20, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]
    streamed = "".join(c.text for c in engine.stream(PROMPT, max_new_tokens=20, stop=stop))
    assert streamed == stopped.text


def test_eos_ends_generation_with_reason_stop():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = KVBoostEngine(model, tok)
    first = engine.generate(PROMPT, max_new_tokens=1)
    engine.eos_ids = frozenset({first.token_ids[0]})  # make the first greedy token the end of sequence
    r = engine.generate(PROMPT, max_new_tokens=10)
    assert r.finish_reason == "stop" and r.token_ids == first.token_ids


def test_max_new_tokens_gives_reason_length(engine):
    engine.eos_ids = frozenset()
    r = engine.generate(PROMPT, max_new_tokens=7)
    assert r.finish_reason == "length" and len(r.token_ids) == 7


def test_threads_get_the_same_answers_as_sequential_calls(engine):
    prompts = [[*PROMPT[:1], Segment(f"Question {i}? ")] for i in range(6)]
    expected = [engine.generate(p, max_new_tokens=6).token_ids for p in prompts]
    got: dict[int, list[int]] = {}

    def worker(i):
        got[i] = engine.generate(prompts[i], max_new_tokens=6).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(6)] == expected


# -- bad input: clear errors that name the fix ------------------------------------------------


@pytest.mark.parametrize("prompt", ["", [], [""], [{"role": "user", "content": ""}][:0]])
def test_empty_prompt(engine, prompt):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate(prompt)


def test_prompt_beyond_context_window():
    model = tiny_model("llama", max_position_embeddings=64)
    engine = KVBoostEngine(model, tiny_tokenizer())
    with pytest.raises(ContextWindowExceededError, match="context window is 64; shorten"):
        engine.generate("word " * 200)


def test_max_new_tokens_is_capped_by_the_context_window():
    model = tiny_model("llama", max_position_embeddings=64)
    engine = KVBoostEngine(model, tiny_tokenizer())
    engine.eos_ids = frozenset()
    n = len(engine.canonicalize("fox " * 10))
    assert n < 48
    r = engine.generate("fox " * 10, max_new_tokens=500)
    assert r.finish_reason == "length" and n + len(r.token_ids) == 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_bad_generation_parameters(engine, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(PROMPT, **kwargs)


def test_unknown_model_names_the_aliases(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        KVBoostEngine.from_pretrained(str(tmp_path / "no-such-model"))


def test_non_causal_model_is_refused(tmp_path):
    from transformers import DistilBertConfig

    DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not a causal language model"):
        KVBoostEngine.from_pretrained(str(tmp_path))


def test_bad_config_value():
    with pytest.raises(ValueError, match="chunk_size"):
        EngineConfig(chunk_size=0)


# -- model families ----------------------------------------------------------------------------


def test_tiny_model_config_matches_the_families_under_test():
    assert tiny_config("gpt2").model_type == "gpt2"
    assert tiny_config("mistral").sliding_window is None


def test_a_stream_left_half_way_does_not_block_other_requests(engine):
    stream = engine.stream(PROMPT, max_new_tokens=20)
    next(stream)  # the generator stays alive, paused in its decode loop
    done: list[int] = []
    worker = threading.Thread(
        target=lambda: done.append(engine.generate(PROMPT, max_new_tokens=3).usage.prompt_tokens)
    )
    worker.start()
    worker.join(timeout=60)
    assert done, "a paused stream kept the engine locked"
    rest = list(stream)  # and the paused stream still finishes correctly
    assert rest[-1].result is not None


def test_auto_dtype_is_bfloat16_only_where_the_cpu_runs_it_natively(monkeypatch):
    from kvboost_rag import models

    monkeypatch.setattr(models, "_cpu_has_native_bfloat16", lambda: False)
    assert models.parse_dtype("auto") == torch.float32
    monkeypatch.setattr(models, "_cpu_has_native_bfloat16", lambda: True)
    assert models.parse_dtype("auto") == torch.bfloat16
    assert models.parse_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="use auto or one of"):
        models.parse_dtype("int8")
