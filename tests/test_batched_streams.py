"""Streams share the scheduler's batches: engine.stream and engine.astream requests run in the same
batches as generate calls, each receiving its deltas as its tokens come out of the shared steps.

Greedy tokens in a batch equal lone runs (see test_batch for the rounding tolerance of logits).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest
from helpers import record_admissions, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request, Segment, StreamOverflowError

SHARED = Segment("A key-value cache stores attention keys and values for every token of the prompt. " * 3)
QUESTIONS = ["Why?", "What does it store for each token?", "Name one", "Is it exact, and how would we know?"]


def prompt(i: int) -> list[Segment]:
    return [SHARED, Segment(QUESTIONS[i % len(QUESTIONS)])]


def make_engine(**config) -> KVBoostEngine:
    return KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16, **config))


@pytest.fixture
def batch_sizes(monkeypatch) -> list[int]:
    return record_admissions(monkeypatch)


def lone(i: int, max_new_tokens: int = 8, **settings):
    return make_engine(max_batch_size=1).generate(prompt(i), max_new_tokens=max_new_tokens, **settings)


def read(stream) -> tuple[str, object]:
    text, result = "", None
    for piece in stream:
        text += piece.text
        result = piece.result
    return text, result


def test_streams_and_generate_calls_share_one_batch_with_lone_greedy_tokens(batch_sizes):
    engine = make_engine(batch_window_ms=300)
    outcomes: dict[int, tuple[str, object]] = {}

    def streamed(i: int) -> None:
        outcomes[i] = read(engine.stream(prompt(i), max_new_tokens=8))

    def whole(i: int) -> None:
        result = engine.generate(prompt(i), max_new_tokens=8)
        outcomes[i] = (result.text, result)

    threads = [threading.Thread(target=streamed if i % 2 == 0 else whole, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert batch_sizes == [4]  # two streams and two generate calls, one batch
    for i in range(4):
        text, result = outcomes[i]
        expected = lone(i)
        assert result.token_ids == expected.token_ids and text == result.text == expected.text
    engine.close()


def test_a_lone_stream_runs_the_exact_path(batch_sizes):
    engine = make_engine()
    text, result = read(engine.stream(prompt(1), max_new_tokens=8, return_logits=True))
    expected = lone(1, return_logits=True)
    assert batch_sizes == [] and result.token_ids == expected.token_ids and text == expected.text
    assert result.first_logits.equal(expected.first_logits)  # bitwise: the single-request path
    engine.close()


def test_streamed_text_before_a_stop_string_is_delivered():
    engine = make_engine()
    full = lone(2, max_new_tokens=12).text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), full
    text, result = read(engine.stream(prompt(2), max_new_tokens=12, stop=[stop]))
    assert text == result.text == full[: full.index(stop)]
    engine.close()


def test_cancelling_one_stream_leaves_the_others_of_its_batch_intact():
    engine = make_engine(batch_window_ms=300)
    doomed = engine.stream(prompt(0), max_new_tokens=400)
    others = [engine.stream(prompt(i), max_new_tokens=8) for i in (1, 2)]
    first = next(doomed)  # the batch runs
    assert first.result is None
    doomed.cancel()
    with pytest.raises(CancelledError):
        read(doomed)
    for i, stream in zip((1, 2), others, strict=True):
        text, result = read(stream)
        assert result.token_ids == lone(i).token_ids and text == result.text
    engine.close()


def test_a_consumer_that_never_reads_is_stopped_without_stalling_the_others():
    engine = make_engine(batch_window_ms=300, stream_buffer_deltas=4)
    ignored = engine.stream(prompt(0), max_new_tokens=200)  # never read while the others run
    readers = [engine.submit(Request(prompt(i), max_new_tokens=8)) for i in (1, 2)]
    for i, future in zip((1, 2), readers, strict=True):
        assert future.result(timeout=120).token_ids == lone(i).token_ids
    with pytest.raises(StreamOverflowError, match="fell behind"):
        read(ignored)
    engine.close()


def test_closing_a_stream_early_stops_its_request():
    engine = make_engine(batch_window_ms=300)
    stream = engine.stream(prompt(0), max_new_tokens=400)
    other = engine.submit(Request(prompt(1), max_new_tokens=8))
    next(stream)
    stream.close()
    assert stream.cancelled
    assert other.result(timeout=120).token_ids == lone(1).token_ids
    engine.close()


def test_astream_requests_join_the_batches_and_a_cancelled_reader_stops_only_its_row(batch_sizes):
    engine = make_engine(batch_window_ms=300)

    async def main():
        async def collect(i: int, max_new_tokens: int = 8) -> tuple[str, object]:
            text, result = "", None
            async for piece in engine.astream(prompt(i), max_new_tokens=max_new_tokens):
                text, result = text + piece.text, piece.result
            return text, result

        doomed = asyncio.create_task(collect(0, max_new_tokens=400))
        readers = asyncio.gather(collect(1), collect(2), engine.agenerate(prompt(3), max_new_tokens=8))
        await asyncio.sleep(0.5)  # the batch runs: the deltas come by callback, no thread per stream
        assert not [t.name for t in threading.enumerate() if t.name == "kvboost-stream"]
        done = await readers
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return done

    (t1, r1), (t2, r2), r3 = asyncio.run(main())
    assert batch_sizes and batch_sizes[0] == 4
    assert (t1, r1.token_ids) == (lone(1).text, lone(1).token_ids)
    assert (t2, r2.token_ids) == (lone(2).text, lone(2).token_ids)
    assert r3.token_ids == lone(3).token_ids
    engine.close()


def test_an_async_reader_that_never_reads_is_stopped_without_stalling_the_others():
    engine = make_engine(batch_window_ms=300, stream_buffer_deltas=4)

    async def main():
        ignored = engine.astream(prompt(0), max_new_tokens=200)
        await ignored.start()  # generating, never read while the others run
        others = await asyncio.gather(*(engine.agenerate(prompt(i), max_new_tokens=8) for i in (1, 2)))
        await asyncio.to_thread(ignored.feed.wait_done, 60)
        with pytest.raises(StreamOverflowError, match="fell behind"):
            async for _ in ignored:
                pass
        return others

    others = asyncio.run(main())
    assert [r.token_ids for r in others] == [lone(i).token_ids for i in (1, 2)]
    engine.close()


def test_a_request_gets_its_result_as_it_ends_not_when_its_batch_does():
    engine = make_engine(batch_window_ms=300)
    long = engine.submit(Request(prompt(0), max_new_tokens=400))
    short = engine.submit(Request(prompt(1), max_new_tokens=8))
    alone = engine.submit(Request(prompt(2), max_new_tokens=8, reuse="blend"))  # runs alone, first
    assert short.result(timeout=120).token_ids == lone(1).token_ids
    assert alone.result(timeout=120).usage.completion_tokens <= 8
    assert not long.done()  # still decoding: the others did not wait for it
    long.cancel()
    engine.close()
