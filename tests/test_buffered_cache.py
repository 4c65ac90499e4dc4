"""Buffered caches start as empty memory: whatever a forward reads must have been written or zeroed.

Unwritten memory is simulated by filling every ``new_empty`` buffer with NaN, which any read of an
unwritten slot would carry into the outputs.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request, Segment
from kvboost_rag.assembler import batch_rows
from kvboost_rag.assembler.buffered_cache import BufferedCache, BufferedLayer, buffered_layers
from kvboost_rag.batch import RunningBatch
from kvboost_rag.block_attention import KEY_BLOCK


def poison(monkeypatch) -> None:
    """From now on every ``Tensor.new_empty`` is NaN (floating point) or -1 (integer) throughout."""
    real = torch.Tensor.new_empty

    def new_empty(self: torch.Tensor, *size, **kwargs) -> torch.Tensor:
        out = real(self, *size, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)


@pytest.fixture
def poisoned(monkeypatch) -> None:
    poison(monkeypatch)


def test_padded_keys_are_zero_past_the_tokens_held(poisoned):
    layer = BufferedLayer(capacity=KEY_BLOCK + 10)
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.pad_keys = True
    padded_k, padded_v = layer.update(keys, values)
    assert padded_k.shape[2] == KEY_BLOCK
    assert torch.equal(padded_k[:, :, :5], keys) and torch.equal(padded_v[:, :, :5], values)
    assert not padded_k[:, :, 5:].any() and not padded_v[:, :, 5:].any()
    layer.truncate(3)  # slots after a truncation still hold finite values
    padded_k, _ = layer.update(keys[:, :, :1], values[:, :, :1])
    assert torch.isfinite(padded_k).all() and torch.equal(padded_k[:, :, 3], keys[:, :, 0])


def _one_row_cache(length: int, capacity: int) -> BufferedCache:
    cache = BufferedCache(num_layers=2, capacity=capacity)
    for layer in buffered_layers(cache):
        layer.update(torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4))
    return cache


def test_joined_rows_pad_the_shorter_rows_with_zeros(poisoned):
    running, joining = _one_row_cache(7, 16), _one_row_cache(3, 8)
    before = [layer.keys.clone() for layer in buffered_layers(joining)]
    batch_rows.join_rows(running, joining, capacity=20)
    for layer, keys in zip(buffered_layers(running), before, strict=True):
        assert layer.length == 7 and layer.keys.shape[0] == 2
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        assert torch.equal(layer.keys[1, :, :3], keys[0]) and not layer.keys[1, :, 3:].any()


def test_a_shared_prefix_taken_out_and_put_back_leaves_the_row_as_it_was(poisoned):
    cache = _one_row_cache(9, 16)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in buffered_layers(cache)]
    shared = batch_rows.share_prefix(cache, 4)
    assert [layer.length for layer in buffered_layers(cache)] == [5, 5]
    assert all(k.shape[2] == 4 for k, _ in shared)
    batch_rows.unshare_prefix(cache, shared)
    for layer, (keys, values) in zip(buffered_layers(cache), before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    with pytest.raises(ValueError, match="one-row cache"):
        batch_rows.share_prefix(cache, 10)


SYSTEM = Segment("Stored keys and values are reused for every token of a prompt that comes back. " * 3)


def _answers(monkeypatch) -> list[list[int]]:
    """A lone request; at its second decode step a request with its prefix joins (the lone row's copy
    becomes the shared one), at its fourth one without it (every row takes its own copy again)."""
    engine = KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16))
    engine.eos_ids = frozenset()
    first = Request([SYSTEM, Segment("Why?")], max_new_tokens=12)
    arrivals = {
        2: Request([SYSTEM, Segment("What is reused?")], max_new_tokens=6),
        4: Request([Segment("Unrelated words, nothing shared."), Segment("Go")], max_new_tokens=4),
    }
    joined: list[Future] = []
    steps = [0]
    real_step = RunningBatch.step

    def step(self: RunningBatch) -> bool:
        going = real_step(self)
        steps[0] += 1
        if steps[0] in arrivals:
            joined.append(engine.submit(arrivals.pop(steps[0])))
        return going

    monkeypatch.setattr(RunningBatch, "step", step)
    answers = [engine.submit(first).result(timeout=120).token_ids]
    answers += [f.result(timeout=120).token_ids for f in joined]
    engine.close()
    monkeypatch.setattr(RunningBatch, "step", real_step)
    return answers


def test_prefills_batches_and_joins_never_read_unwritten_memory(monkeypatch):
    clean = _answers(monkeypatch)
    assert len(clean) == 3
    poison(monkeypatch)
    assert _answers(monkeypatch) == clean


def test_extend_lays_runs_in_order_as_one_update_would(poisoned):
    runs = [torch.randn(2, n, 4) for n in (3, KEY_BLOCK, 7)]  # [kv_heads, tokens, head_dim]
    value_runs = [torch.randn(2, r.shape[1], 4) for r in runs]
    extended, updated = BufferedLayer(capacity=8), BufferedLayer(capacity=8)  # both grow past capacity
    extended.update(runs[0][None, :, :1], value_runs[0][None, :, :1])
    updated.update(runs[0][None, :, :1], value_runs[0][None, :, :1])
    extended.extend(runs, value_runs)
    updated.update(torch.cat(runs, dim=1)[None], torch.cat(value_runs, dim=1)[None])
    assert extended.get_seq_length() == updated.get_seq_length() == 1 + 3 + KEY_BLOCK + 7
    assert torch.equal(extended.keys, updated.keys) and torch.equal(extended.values, updated.values)
    extended.pad_keys = True  # what it holds reads as written, the padded rest as zeros
    padded_k, _ = extended.update(runs[2][None, :, :1], value_runs[2][None, :, :1])
    assert torch.isfinite(padded_k).all()


def test_extend_on_an_empty_layer_starts_its_buffers():
    layer = BufferedLayer(capacity=4)
    keys, values = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    layer.extend([keys], [values])
    assert torch.equal(layer.keys[0], keys) and torch.equal(layer.values[0], values)


def test_a_sliding_layer_drops_the_blocks_behind_its_window_and_keeps_counting_positions(poisoned):
    """Positions stay the unit: after dropping, slot 0 holds ``start``, new tokens follow the last."""
    layer = BufferedLayer(capacity=3 * KEY_BLOCK, window=128)
    keys, values = torch.randn(1, 2, 1300, 4), torch.randn(1, 2, 1300, 4)
    layer.update(keys, values)
    layer.drop_behind(1300, keep_from=600)  # the reply from 600 on is still to be read
    assert layer.start == 512  # keep_from's key block: behind the window, but kept
    layer.drop_behind(1300)  # block 2's queries reach back to block 1 (window 128)
    assert (layer.start, layer.get_seq_length()) == (512, 1300)
    assert layer._k.shape[2] == 2 * KEY_BLOCK + KEY_BLOCK  # what is left, plus a block of room
    assert torch.equal(layer.keys, keys[:, :, 512:]) and torch.equal(layer.values, values[:, :, 512:])
    more = torch.randn(1, 2, 5, 4)
    layer.update(more, more)
    assert layer.get_seq_length() == 1305 and torch.equal(layer.keys[:, :, -5:], more)
    with pytest.raises(ValueError, match="dropped"):
        layer.truncate(400)
    layer.restore_dropped()  # as a batch reads it: every position from 0, the dropped ones zero
    assert layer.start == 0 and layer.keys.shape[2] == 1305
    assert not layer.keys[:, :, :512].any() and torch.equal(layer.keys[:, :, 512:1300], keys[:, :, 512:])


def test_full_attention_layers_never_drop():
    cache = BufferedCache(2, 3 * KEY_BLOCK, windows=[128, None])
    for layer in buffered_layers(cache):
        layer.update(torch.randn(1, 2, 1300, 4), torch.randn(1, 2, 1300, 4))
    cache.drop_behind(1300)
    assert cache.key_starts() == [512, 0] and cache.held_from == 512
