"""Finding stored document tokens in a prompt: anchors move with the tokens, the longest run wins,
short last chunks are found after the chunk before them."""

from __future__ import annotations

import random

import numpy as np

from kvboost_rag.blend_match import ANCHOR_TOKENS, anchor_keys, anchor_offsets, find_runs, remembered
from kvboost_rag.registry import Source

NS = "00" * 32


def tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 5000), k=n)


class Recorded:
    """A registry and store in memory: chunks of documents stored under made-up prefix keys."""

    def __init__(self) -> None:
        self.sources: dict[str, Source] = {}
        self.chunks: dict[str, list[int]] = {}

    def store(self, name: str, ids: list[int], start: int = 0) -> None:
        self.chunks[name] = ids
        self.sources |= {k: Source(name, start) for k in anchor_keys(NS, ids)}

    def runs(self, prompt: list[int], matchable: np.ndarray | None = None) -> list[tuple[int, int, str, int]]:
        ok = np.ones(len(prompt), dtype=bool) if matchable is None else matchable
        found = find_runs(
            prompt,
            ok,
            0,
            len(prompt),
            namespace=NS,
            lookup=lambda keys: {k: self.sources[k] for k in keys if k in self.sources},
            stored_tokens=self.chunks.get,
        )
        return [(r.start, r.end, r.source.prefix_key, r.offset) for r in found]


def test_anchor_offsets_depend_on_the_tokens_alone():
    ids = tokens(1, 300)
    offsets = anchor_offsets(ids)
    assert 300 / 16 < len(offsets) < 300 / 4  # about one per ANCHOR_SPACING tokens
    assert list(anchor_offsets([7, 8, 9] + ids) - 3) == list(offsets)


def test_a_document_is_found_after_any_text_and_before_any_text():
    doc = tokens(2, 150)
    recorded = Recorded()
    for i in range(0, 150, 64):  # stored in chunks of 64, the last one short (22 tokens)
        recorded.store(f"chunk{i}", doc[i : i + 64], start=i)
    prompt = tokens(3, 37) + doc + tokens(4, 20)
    runs = recorded.runs(prompt)
    assert [(s, e) for s, e, _, _ in runs] == [(37, 101), (101, 165), (165, 187)]
    assert [(name, offset) for _, _, name, offset in runs] == [("chunk0", 0), ("chunk64", 0), ("chunk128", 0)]


def test_a_short_last_chunk_without_an_anchor_of_its_own_is_found_after_its_predecessor():
    doc = tokens(5, 64 + ANCHOR_TOKENS - 3)
    tail = doc[64:]
    assert len(anchor_offsets(tail)) == 0  # too short for a content-defined window
    recorded = Recorded()
    recorded.store("head", doc[:64])
    recorded.store("tail", tail, start=64)
    prompt = tokens(6, 10) + doc + tokens(7, 10)
    assert recorded.runs(prompt)[-1][:3] == (74, 74 + len(doc) - 64, "tail")


def test_a_window_shared_by_chance_loses_to_the_document_it_belongs_to():
    doc, other = tokens(8, 64), tokens(9, 64)
    other[20:40] = doc[30:50]  # another stored text shares 20 tokens with the document
    recorded = Recorded()
    recorded.store("doc", doc)
    recorded.store("other", other)  # recorded last: the shared windows point to it
    runs = recorded.runs(tokens(10, 5) + doc)
    assert runs == [(5, 69, "doc", 0)]


def test_unmatchable_tokens_split_runs():
    doc = tokens(11, 64)
    recorded = Recorded()
    recorded.store("doc", doc)
    ok = np.ones(64, dtype=bool)
    ok[32] = False  # template glue in the middle
    runs = recorded.runs(doc, ok)
    assert all(not (s <= 32 < e) for s, e, _, _ in runs) and sum(e - s for s, e, _, _ in runs) >= 40


def test_a_remembered_lookup_asks_each_key_once():
    asked: list[list[str]] = []

    def lookup(keys: list[str]) -> dict[str, Source]:
        asked.append(keys)
        return {k: Source("p", 0) for k in keys if k.startswith("known")}

    ask = remembered(lookup)
    assert ask(["known1", "gone"]) == {"known1": Source("p", 0)}
    assert ask(["gone", "known1", "known2"]) == {"known1": Source("p", 0), "known2": Source("p", 0)}
    assert asked == [["known1", "gone"], ["known2"]]  # absent keys are remembered too
