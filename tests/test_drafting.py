"""Prompt-lookup drafts (kvboost_rag.drafting): the continuation of the latest earlier occurrence of the
longest suffix found."""

from __future__ import annotations

from kvboost_rag.drafting import NgramDrafter


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # "1 2 3" occurred at the start (followed by 4 5); "3" alone occurred later (followed by 9)
    drafter = NgramDrafter([1, 2, 3, 4, 5, 3, 9, 1, 2, 3], max_ngram=3)
    assert drafter.draft(2) == [4, 5]


def test_the_latest_occurrence_is_taken():
    drafter = NgramDrafter([7, 8, 1, 7, 8, 2, 7, 8], max_ngram=2)
    assert drafter.draft(1) == [2]


def test_drafts_follow_the_tokens_appended():
    drafter = NgramDrafter([10, 11, 12, 13], max_ngram=2)
    assert drafter.draft(3) == []  # nothing repeats yet
    drafter.extend([10, 11])
    assert drafter.draft(3) == [12, 13, 10]  # the continuation may run into the suffix itself
    drafter.extend(range(100, 300))  # grows past its first capacity
    assert len(drafter) == 206 and drafter.draft(4) == []


def test_no_drafts_are_asked_or_possible():
    assert NgramDrafter([1, 2, 1, 2]).draft(0) == []
    assert NgramDrafter([5]).draft(4) == []
    assert NgramDrafter([]).draft(4) == []
