"""Continuous batching: a request that arrives while a batch decodes joins it at the next step, and a
row that ends leaves at once; greedy tokens still equal lone runs (see test_batch for the rounding
tolerance of logits).

Arrivals are made deterministic by submitting from inside a chosen decode step (on the worker thread,
so the next step offers them to the batch).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import pytest
from helpers import record_admissions, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request, Segment, StreamOverflowError
from kvboost_rag.batch import RunningBatch

SHARED = Segment("A key-value cache stores attention keys and values for every token of the prompt. " * 3)
OTHER = Segment("Rotary embeddings turn positions into angles; blend mode rotates stored keys again. " * 3)
QUESTIONS = ["Why?", "What does it store for each token?", "Name one", "Is it exact, and how would we know?"]


JOIN_AT_STEP = 9  # the tiny model's reply cycles by then: drafts are confirmed, and some wait for their check


def prompt(i: int, system: Segment = SHARED) -> list[Segment]:
    return [system, Segment(QUESTIONS[i % len(QUESTIONS)])]


def make_engine(**config) -> KVBoostEngine:
    engine = KVBoostEngine(
        tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size=16, **config)
    )
    engine.eos_ids = frozenset()  # random weights: never stop early, every answer has max_new_tokens
    return engine


def lone(request: Request) -> list[int]:
    engine = make_engine(max_batch_size=1)
    token_ids = engine.generate(request).token_ids
    engine.close()
    return token_ids


@pytest.fixture
def admissions(monkeypatch) -> list[int]:
    return record_admissions(monkeypatch)


@pytest.fixture
def at_step(monkeypatch) -> Callable[[int, Callable[[], None]], None]:
    """``at_step(n, action)``: run ``action`` on the worker right after the n-th decode step (counted
    over every batch, from 1)."""
    actions: dict[int, Callable[[], None]] = {}
    steps = [0]
    real_step = RunningBatch.step

    def step(self: RunningBatch) -> bool:
        going = real_step(self)
        steps[0] += 1
        if steps[0] in actions:
            actions.pop(steps[0])()
        return going

    monkeypatch.setattr(RunningBatch, "step", step)
    return actions.__setitem__


def ended_in_order(futures: dict[str, Future]) -> list[str]:
    """The names of ``futures`` in the order they complete (recorded as they do)."""
    order: list[str] = []
    lock = threading.Lock()
    for name, future in futures.items():

        def record(_: Future, name: str = name) -> None:
            with lock:
                order.append(name)

        future.add_done_callback(record)
    return order


def test_requests_arriving_mid_batch_join_at_the_next_step_and_leave_as_they_end(admissions, at_step):
    engine = make_engine(batch_window_ms=300)
    longs = [Request(prompt(i), max_new_tokens=24) for i in (0, 1)]
    joiner = Request(prompt(2), max_new_tokens=6)
    streamed = Request(prompt(3), max_new_tokens=6)
    joined: dict[str, object] = {}

    def arrive() -> None:
        joined["future"] = engine.submit(joiner)
        joined["stream"] = engine.stream(streamed)

    at_step(3, arrive)  # two rows are decoding their third token
    futures = {f"long{i}": engine.submit(r) for i, r in enumerate(longs)}
    order = ended_in_order(futures)
    results = [f.result(timeout=120) for f in futures.values()]
    joined_result = joined["future"].result(timeout=120)  # type: ignore[attr-defined]
    pieces = list(joined["stream"])  # type: ignore[call-overload]
    engine.close()

    assert admissions == [2, 2]  # both arrivals joined the running batch, as one admission
    assert order == ["long0", "long1"]
    assert joined_result.timings.total_s < results[0].timings.total_s  # it left before the batch ended
    assert [r.token_ids for r in results] == [lone(r) for r in longs]
    assert joined_result.token_ids == lone(joiner)
    stream_result = pieces[-1].result
    assert stream_result.token_ids == lone(streamed)
    assert "".join(p.text for p in pieces) == stream_result.text


def test_a_joiner_without_the_shared_prefix_joins_and_the_rows_keep_their_own_copy(admissions, at_step):
    engine = make_engine(batch_window_ms=300)
    longs = [Request(prompt(i), max_new_tokens=16) for i in (0, 1)]
    stranger = Request(prompt(2, system=OTHER), max_new_tokens=6)
    late = Request(prompt(3), max_new_tokens=4)  # shares the prefix again: joins the unshared rows
    joined: list[Future] = []
    at_step(2, lambda: joined.append(engine.submit(stranger)))
    at_step(4, lambda: joined.append(engine.submit(late)))
    futures = [engine.submit(r) for r in longs]
    results = [f.result(timeout=120) for f in futures]
    joined_results = [f.result(timeout=120) for f in joined]
    engine.close()

    assert admissions == [2, 1, 1]
    assert [r.token_ids for r in results] == [lone(r) for r in longs]
    assert [r.token_ids for r in joined_results] == [lone(stranger), lone(late)]


def test_a_lone_request_shares_its_prefix_with_the_rows_that_join_it(monkeypatch, at_step):
    shared_at_admission: list[int] = []
    real_admit = RunningBatch.admit

    def admit(self: RunningBatch, rows) -> None:
        shared_at_admission.append(self.shared_tokens)
        real_admit(self, rows)

    monkeypatch.setattr(RunningBatch, "admit", admit)
    engine = make_engine(batch_window_ms=0)
    first = Request(prompt(0), max_new_tokens=16)
    sharer = Request(prompt(1), max_new_tokens=8)
    stranger = Request(prompt(2, system=OTHER), max_new_tokens=4)  # the rows then keep their own copy
    joined: list[Future] = []
    at_step(2, lambda: joined.append(engine.submit(sharer)))
    at_step(4, lambda: joined.append(engine.submit(stranger)))
    first_result = engine.submit(first).result(timeout=120)
    joined_results = [f.result(timeout=120) for f in joined]
    system_tokens = len(engine.canonicalize([SHARED], add_generation_prompt=False).token_ids)
    engine.close()

    assert len(shared_at_admission) == 2  # the first request started alone; each arrival joined it
    assert 0 < shared_at_admission[0] <= system_tokens  # the lone row's copy became the shared one
    assert shared_at_admission[1] == 0  # the stranger made every row hold its own copy again
    assert first_result.token_ids == lone(first)
    assert [r.token_ids for r in joined_results] == [lone(sharer), lone(stranger)]


def test_a_joiner_that_must_run_alone_waits_for_the_batch_to_drain(admissions, at_step):
    engine = make_engine(batch_window_ms=300)
    longs = [Request(prompt(i), max_new_tokens=12) for i in (0, 1)]
    alone = Request(prompt(2), max_new_tokens=4, reuse="blend")
    beside = Request(prompt(3), max_new_tokens=4)  # arrives with it, and can join
    later = Request(prompt(1), max_new_tokens=4)  # arrives after it: the draining batch takes no one
    futures: dict[str, Future] = {}
    order: list[str] = []

    def arrive(names: tuple[str, ...], requests: tuple[Request, ...]) -> None:
        for name, request in zip(names, requests, strict=True):
            futures[name] = engine.submit(request)
            futures[name].add_done_callback(lambda _, name=name: order.append(name))

    at_step(2, lambda: arrive(("alone", "beside"), (alone, beside)))
    at_step(4, lambda: arrive(("later",), (later,)))
    arrive(("long0", "long1"), tuple(longs))
    for name in ("long0", "long1", "beside"):
        futures[name].result(timeout=120)
    results = {name: futures[name].result(timeout=120) for name in ("alone", "later")}
    engine.close()

    assert admissions == [2, 1]  # "beside" joined; "alone", then "later", ran alone after the batch
    assert order == ["beside", "long0", "long1", "alone", "later"]
    assert results["alone"].usage.completion_tokens == 4
    assert futures["beside"].result().token_ids == lone(beside)
    assert results["later"].token_ids == lone(later)


def test_cancelling_a_joined_stream_stops_only_its_row(admissions, at_step):
    engine = make_engine(batch_window_ms=300)
    longs = [Request(prompt(i), max_new_tokens=20) for i in (0, 1)]
    streams: list = []
    at_step(2, lambda: streams.append(engine.stream(Request(prompt(2), max_new_tokens=400))))
    futures = [engine.submit(r) for r in longs]
    while not streams:  # the arrival is made on the worker
        threading.Event().wait(0.01)
    doomed = streams[0]
    assert next(doomed).result is None  # it has joined and is generating
    doomed.cancel()
    with pytest.raises(CancelledError):
        list(doomed)
    results = [f.result(timeout=120) for f in futures]
    engine.close()

    assert admissions == [2, 1]
    assert [r.token_ids for r in results] == [lone(r) for r in longs]


def test_a_joined_stream_whose_consumer_never_reads_is_stopped_without_stalling_the_others(at_step):
    engine = make_engine(batch_window_ms=300, stream_buffer_deltas=4)
    longs = [Request(prompt(i), max_new_tokens=24) for i in (0, 1)]
    ignored: list = []
    at_step(1, lambda: ignored.append(engine.stream(Request(prompt(2), max_new_tokens=200))))
    futures = [engine.submit(r) for r in longs]
    results = [f.result(timeout=120) for f in futures]
    engine.close()

    assert [r.token_ids for r in results] == [lone(r) for r in longs]
    with pytest.raises(StreamOverflowError, match="fell behind"):
        list(ignored[0])


def test_a_batch_fills_up_to_max_batch_size_and_the_rest_waits(admissions, at_step):
    engine = make_engine(batch_window_ms=300, max_batch_size=3)
    longs = [Request(prompt(i), max_new_tokens=10) for i in (0, 1)]
    arrivals = [Request(prompt(i), max_new_tokens=4) for i in (2, 3)]
    joined: list[Future] = []
    at_step(2, lambda: joined.extend(engine.submit(r) for r in arrivals))
    futures = [engine.submit(r) for r in longs]
    results = [f.result(timeout=120) for f in futures]
    results += [f.result(timeout=120) for f in joined]  # submitted at step 2, before the longs ended
    engine.close()

    assert admissions == [2, 1, 1]  # one free row: the first arrival joins, the second when it leaves
    assert [r.token_ids for r in results] == [lone(r) for r in longs + arrivals]


def test_a_lone_row_with_drafts_in_flight_joins_a_batch_and_keeps_its_tokens(monkeypatch, at_step):
    """The lone row drafts ahead; when others join, its unconfirmed drafts leave its cache first."""
    in_flight: list[int] = []
    real_end_lone = RunningBatch._end_lone

    def end_lone(self: RunningBatch) -> None:
        if self._stepper is not None:
            in_flight.append(len(self._stepper._pending))
        real_end_lone(self)

    monkeypatch.setattr(RunningBatch, "_end_lone", end_lone)
    engine = make_engine(batch_window_ms=0)
    quoting = Request([Segment("The quick brown fox jumps over the lazy dog. " * 6)], max_new_tokens=24)
    joiner = Request(prompt(1), max_new_tokens=6)
    joined: list[Future] = []
    at_step(JOIN_AT_STEP, lambda: joined.append(engine.submit(joiner)))
    result = engine.submit(quoting).result(timeout=120)
    joined_result = joined[0].result(timeout=120)
    engine.close()
    assert in_flight and in_flight[0] > 0  # drafts were waiting for their check when the joiner came
    assert result.usage.accepted_tokens > 0
    assert result.token_ids == lone(quoting)
    assert joined_result.token_ids == lone(joiner)
