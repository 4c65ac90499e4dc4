"""engine.astream: native asyncio streams; the same tokens as generate, and stopping a reader stops the
request (at its next layer, in a long prefill too)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import CancelledError

import pytest
from helpers import LayerSpy, run_while_ticking, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, InvalidRequestError, KVBoostEngine

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens
PROMPT = "Tell me about the quick brown fox."


def make_engine() -> KVBoostEngine:
    return KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16))


def test_astream_gives_the_tokens_of_generate_and_keeps_the_loop_free():
    engine = make_engine()
    whole = engine.generate(PROMPT, max_new_tokens=12)

    async def read():
        return [piece async for piece in engine.astream(PROMPT, max_new_tokens=12)]

    pieces, ticks, seconds = run_while_ticking(read, tick_s=0.005)
    assert "".join(p.text for p in pieces) == whole.text
    assert pieces[-1].result is not None and pieces[-1].result.token_ids == whole.token_ids
    assert all(p.result is None for p in pieces[:-1])
    assert ticks >= 0.2 * seconds / 0.005  # the loop ran other work while the model computed
    engine.close()


async def test_bad_input_raises_at_start_before_any_work():
    engine = make_engine()
    stream = engine.astream([], max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="empty"):
        await stream.start()
    engine.close()


@pytest.mark.parametrize("how", ["cancel", "aclose", "task"])
async def test_stopping_the_reader_stops_the_prefill_at_the_next_layer(how):
    engine = make_engine()
    spy = LayerSpy(engine)
    stream = engine.astream(LONG, max_new_tokens=4)
    entered = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def read():
        return [piece async for piece in stream]

    def in_layer_0() -> None:  # on the model's thread: hold the forward until the reader has stopped it
        loop.call_soon_threadsafe(entered.set)
        deadline = time.monotonic() + 60
        while not (stream.feed is not None and stream.feed.stopped) and time.monotonic() < deadline:
            time.sleep(0.001)

    spy.cancel = in_layer_0
    task = asyncio.create_task(read())
    await asyncio.wait_for(entered.wait(), 60)
    if how == "cancel":
        stream.cancel()
    elif how == "aclose":
        await stream.aclose()
    else:
        task.cancel()
    with pytest.raises((CancelledError, asyncio.CancelledError)):
        await asyncio.wait_for(task, 60)
    await asyncio.to_thread(stream.feed.wait_done, 60)
    assert spy.after == [0]  # layer 1 never ran
    spy.remove()
    assert engine.generate(PROMPT, max_new_tokens=3).usage.completion_tokens == 3  # the engine serves on
    engine.close()
