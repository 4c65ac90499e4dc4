"""The prefix index: the stored chunk sharing the most leading tokens, under one parent key only."""

from __future__ import annotations

from kvboost_rag.prefix_index import PrefixIndex


def test_the_longest_shared_prefix_wins_and_other_parents_never_match() -> None:
    index = PrefixIndex()
    index.add("p", "short", [5, 6])
    index.add("p", "long", [5, 6, 7, 8])
    index.add("p", "other", [9, 9, 9])
    index.add("q", "elsewhere", [5, 6, 7, 8, 1])
    assert index.longest_prefix("p", [5, 6, 7, 1]) == ("long", 3)
    assert index.longest_prefix("p", [5]) in {("short", 1), ("long", 1)}
    assert index.longest_prefix("p", [1, 2]) is None
    assert index.longest_prefix("r", [5, 6]) is None
    assert len(index) == 4


def test_discarded_chunks_are_forgotten_and_re_adding_does_not_count_twice() -> None:
    index = PrefixIndex()
    index.add("p", "k", [1, 2, 3])
    index.add("p", "k", [1, 2, 3])
    assert len(index) == 1
    index.discard("p", "k")
    index.discard("p", "missing")
    assert index.longest_prefix("p", [1, 2, 3]) is None and len(index) == 0


def test_past_its_bound_it_forgets_the_parents_used_longest_ago() -> None:
    index = PrefixIndex(max_chunks=4)
    for parent in ("a", "b"):
        index.add(parent, f"{parent}1", [1])
        index.add(parent, f"{parent}2", [2])
    assert index.longest_prefix("a", [1]) == ("a1", 1)  # "a" is now the most recently used
    index.add("c", "c1", [3])
    assert len(index) == 3
    assert index.longest_prefix("b", [1]) is None
    assert index.longest_prefix("a", [2]) == ("a2", 1)
    assert index.longest_prefix("c", [3]) == ("c1", 1)
