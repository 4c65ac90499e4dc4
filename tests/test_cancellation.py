"""Cancellation: a request stops at its next layer, in a long prefill too; the others and the store
are unaffected.

A spy on the layers' cache writes (:class:`helpers.LayerSpy`) cancels the request as a long forward
reaches its first layer, and records every layer reached afterwards: a prefill that honours the
cancellation reaches none but that first one.
"""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest
import torch
from helpers import LayerSpy, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens
SHORT = "Why?"


def make_engine(**config) -> KVBoostEngine:
    return KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16, **config))


def fresh_logits(prompt: str) -> torch.Tensor:
    return make_engine().generate(prompt, max_new_tokens=1, return_logits=True).first_logits


def test_a_stream_cancelled_in_its_prefill_stops_at_the_next_layer():
    engine = make_engine()
    spy = LayerSpy(engine)
    stream = engine.stream(LONG, max_new_tokens=4)
    spy.cancel = stream.cancel
    with pytest.raises(CancelledError):
        list(stream)
    assert spy.fired.is_set() and spy.after == [0]  # layer 1 never ran
    spy.remove()
    # what the cancelled prefill left in the store is valid: the same bits as a fresh engine
    again = engine.generate(LONG, max_new_tokens=1, return_logits=True)
    assert torch.equal(again.first_logits, fresh_logits(LONG))
    engine.close()


def test_a_submitted_request_cancelled_in_its_prefill_stops_at_the_next_layer():
    engine = make_engine(batch_window_ms=0)
    spy = LayerSpy(engine)
    future = engine.submit(Request(LONG, max_new_tokens=4))
    spy.cancel = future.cancel
    with pytest.raises(CancelledError):
        future.result(timeout=60)
    assert spy.after == [0]
    spy.remove()
    assert engine.generate(SHORT, max_new_tokens=3).usage.completion_tokens == 3  # the engine serves on
    engine.close()


def test_a_request_cancelled_while_it_is_prepared_runs_no_forward(monkeypatch):
    engine = make_engine(batch_window_ms=0)
    spy = LayerSpy(engine, tokens=1)
    futures = []
    real_prepare = engine.generation.prepare

    def prepare(request, submitted_at):
        ready = real_prepare(request, submitted_at)
        futures[0].cancel()  # the client goes away while its prompt is canonicalized
        return ready

    monkeypatch.setattr(engine.generation, "prepare", prepare)
    futures.append(engine.submit(Request(LONG, max_new_tokens=4)))
    with pytest.raises(CancelledError):
        futures[0].result(timeout=60)
    assert not spy.fired.is_set()
    spy.remove()
    engine.close()


def test_a_batch_row_cancelled_in_its_prefix_prefill_leaves_the_others_intact():
    engine = make_engine(batch_window_ms=300)
    lone = make_engine().generate(SHORT, max_new_tokens=6)
    spy = LayerSpy(engine)
    long = engine.submit(Request(LONG + "Tell me more.", max_new_tokens=6))
    short = engine.submit(Request(SHORT, max_new_tokens=6))
    spy.cancel = long.cancel
    with pytest.raises(CancelledError):
        long.result(timeout=60)
    assert short.result(timeout=60).token_ids == lone.token_ids
    assert spy.after == [0]
    spy.remove()
    engine.close()
