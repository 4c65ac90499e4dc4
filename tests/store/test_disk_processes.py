"""Disk tier shared by processes at once: writers and readers on one directory (DESIGN.md contract 5)."""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback

import pytest
import torch

from kvboost_rag.store.base import StoredChunk
from kvboost_rag.store.disk import DiskStore

NS = "model-a|tok|float32|v1"
WRITERS, KEYS_PER_WRITER, READERS = 3, 30, 2
ALL_KEYS = [(w, i) for w in range(WRITERS) for i in range(KEYS_PER_WRITER)]


def key_of(w: int, i: int) -> str:
    return f"w{w}-{i:0>61}"


def chunk_of(w: int, i: int) -> StoredChunk:
    """The chunk every process expects under ``key_of(w, i)``; every 7th is big enough to be a file."""
    g = torch.Generator().manual_seed(1000 * w + i)
    tokens = 160 if i % 7 == 0 else 3
    last = torch.randn(11, generator=g) if i % 3 == 0 else None
    dtype = torch.bfloat16 if w == 1 else torch.float32
    return StoredChunk(torch.randn(2, 2, 2, tokens, 16, generator=g).to(dtype), last)


def same(a: StoredChunk, b: StoredChunk) -> bool:
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    if a.kv.dtype != b.kv.dtype or a.kv.shape != b.kv.shape or not torch.equal(raw(a.kv), raw(b.kv)):
        return False
    if (a.last_logits is None) != (b.last_logits is None):
        return False
    return a.last_logits is None or torch.equal(raw(a.last_logits), raw(b.last_logits))


def writer(directory: str, w: int, start, results) -> None:
    try:
        store = DiskStore(directory, namespace=NS)
        start.wait(timeout=120)
        for i in range(KEYS_PER_WRITER):
            store.put(key_of(w, i), chunk_of(w, i), cost=float(i + 1), pin=i == 0)
            if i % 10 == 9:
                store.flush()  # let readers see some entries while others are still on their way
        store.close()
        results.put(("writer", w, None))
    except BaseException:  # noqa: BLE001  (whatever it is, the parent process must hear of it)
        results.put(("writer", w, traceback.format_exc()))


def reader(directory: str, r: int, start, stop, results) -> None:
    """Read random keys until told to stop, then every key once: a miss or the exact chunk, never an error."""
    hits = misses = 0
    bad: list[str] = []
    try:
        store = DiskStore(directory, namespace=NS)
        rng = random.Random(r)
        start.wait(timeout=120)
        while not stop.is_set():
            w, i = rng.choice(ALL_KEYS)
            hit = store.get(key_of(w, i))
            if hit is None:
                misses += 1
            elif same(hit.chunk, chunk_of(w, i)):
                hits += 1
            else:
                bad.append(key_of(w, i))
        # every writer has closed its store: all entries are visible to this already open store
        for w, i in ALL_KEYS:
            hit = store.get(key_of(w, i))
            if hit is None or not same(hit.chunk, chunk_of(w, i)):
                bad.append(f"final {key_of(w, i)}")
        corrupt = store.stats()["disk"].extra.get("corrupt", 0)
        store.close()
        results.put(("reader", r, (hits, misses, bad, corrupt)))
    except BaseException:  # noqa: BLE001  (whatever it is, the parent process must hear of it)
        results.put(("reader", r, traceback.format_exc()))


@pytest.mark.slow  # ~20 s here: five fresh interpreters each import torch and transformers
def test_concurrent_writers_and_readers_share_one_directory(tmp_path):
    directory = str(tmp_path / "store")
    DiskStore(directory, namespace=NS).close()  # create the directory and databases once
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(WRITERS + READERS)
    stop = ctx.Event()
    results = ctx.Queue()
    readers = [ctx.Process(target=reader, args=(directory, r, start, stop, results)) for r in range(READERS)]
    writers = [ctx.Process(target=writer, args=(directory, w, start, results)) for w in range(WRITERS)]
    procs = readers + writers
    for p in procs:
        p.start()
    try:
        for p in writers:
            p.join(timeout=60)
        stop.set()
        for p in readers:
            p.join(timeout=60)
        outcome = {}
        for _ in procs:
            kind, n, value = results.get(timeout=10)
            outcome[kind, n] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * len(procs)

    for w in range(WRITERS):
        assert outcome["writer", w] is None, outcome["writer", w]
    for r in range(READERS):
        value = outcome["reader", r]
        assert not isinstance(value, str), value  # a traceback
        _hits, _misses, bad, corrupt = value
        assert bad == [], f"reader {r} got wrong or missing chunks: {bad[:5]}"
        assert corrupt == 0, f"reader {r} took {corrupt} entries for corrupt"

    fresh = DiskStore(directory, namespace=NS)
    try:
        assert sorted(fresh.keys()) == sorted(key_of(w, i) for w, i in ALL_KEYS)
        for w, i in ALL_KEYS:
            hit = fresh.get(key_of(w, i))
            assert hit is not None and same(hit.chunk, chunk_of(w, i)), key_of(w, i)
        s = fresh.stats()["disk"]
        assert s.entries == WRITERS * KEYS_PER_WRITER
        assert s.pinned == WRITERS
        assert fresh.namespaces()[NS][0] == WRITERS * KEYS_PER_WRITER
    finally:
        fresh.close()
