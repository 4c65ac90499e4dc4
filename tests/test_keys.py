"""Segment groups, chunks and their keys (contracts 1 and 3)."""

from __future__ import annotations

import re

import pytest

from kvboost_rag.canonical import CanonicalPrompt, Segment
from kvboost_rag.keys import chunk_spans, content_key, group_spans, make_namespace, plan_chunks

NS = make_namespace(model="m", tokenizer="t", dtype="float32")


def prompt(*parts):
    """A CanonicalPrompt from ``(kind, ids)`` pairs; the text is irrelevant to chunking."""
    segments = tuple(Segment(f"s{i}", kind) for i, (kind, _) in enumerate(parts))
    return CanonicalPrompt(segments, tuple(tuple(ids) for _, ids in parts))


def ids(start, n):
    return list(range(start, start + n))


# -- groups and chunk spans ----------------------------------------------------


def test_plain_segments_are_their_own_groups():
    p = prompt(("text", ids(1, 3)), ("document", ids(10, 5)), ("text", ids(20, 2)))
    assert group_spans(p) == [(0, 3), (3, 8), (8, 10)]


def test_glue_joins_the_next_segment():
    p = prompt(("glue", ids(1, 2)), ("message", ids(10, 3)), ("glue", ids(20, 4)), ("message", ids(30, 1)))
    assert group_spans(p) == [(0, 5), (5, 10)]


def test_consecutive_glue_joins_the_next_segment():
    p = prompt(("text", [1]), ("glue", [2, 3]), ("glue", [4]), ("document", [5, 6]))
    assert group_spans(p) == [(0, 1), (1, 6)]


def test_trailing_glue_is_a_group_of_its_own():
    """The generation prompt opens the reply in the next turn, so it must not change earlier chunks."""
    p = prompt(("glue", [1]), ("message", [2, 3]), ("glue", [4, 5, 6]))
    assert group_spans(p) == [(0, 3), (3, 6)]
    p = prompt(("text", [1, 2]), ("document", [3]), ("glue", [4, 5]))
    assert group_spans(p) == [(0, 2), (2, 3), (3, 5)]


def test_closing_template_text_joins_the_previous_group():
    p = prompt(
        ("glue", [1]),
        ("message", [2, 3]),
        ("closing", [4]),
        ("glue", [5]),
        ("message", [6]),
        ("closing", [7, 8]),
    )
    assert group_spans(p) == [(0, 4), (4, 8)]


def test_only_glue_is_one_group():
    p = prompt(("glue", [1, 2]), ("glue", [3]))
    assert group_spans(p) == [(0, 3)]


def test_empty_segments_are_skipped():
    p = prompt(("text", [1, 2]), ("document", []), ("glue", []), ("text", [3]))
    assert group_spans(p) == [(0, 2), (2, 3)]


def test_chunks_never_cross_a_group_boundary():
    p = prompt(
        ("text", ids(0, 10)), ("document", ids(100, 3)), ("glue", ids(200, 2)), ("message", ids(300, 7))
    )
    spans = chunk_spans(p, 4)
    # each group cut from its own start, the last chunk of a group may be short
    assert spans == [(0, 4), (4, 8), (8, 10), (10, 13), (13, 17), (17, 21), (21, 22)]
    groups = group_spans(p)
    for start, end in spans:
        assert 0 < end - start <= 4
        assert any(g0 <= start and end <= g1 for g0, g1 in groups)
    # the chunks tile the prompt
    assert [s for s, _ in spans[1:]] == [e for _, e in spans[:-1]]
    assert spans[0][0] == 0 and spans[-1][1] == len(p)


def test_chunk_spans_of_a_segment_do_not_depend_on_what_precedes_it():
    doc = ("document", ids(500, 11))
    for before in ([], [("text", ids(0, 1))], [("text", ids(0, 7)), ("text", ids(50, 3))]):
        p = prompt(*before, doc)
        offset = sum(len(i) for _, i in before)
        doc_spans = [(s - offset, e - offset) for s, e in chunk_spans(p, 4) if s >= offset]
        assert doc_spans == [(0, 4), (4, 8), (8, 11)]


# -- prefix keys -------------------------------------------------------------


def keys(p, chunk_size=4, namespace=NS):
    return [c.key for c in plan_chunks(p, chunk_size, namespace)]


def test_plan_chunks_matches_chunk_spans():
    p = prompt(("text", ids(0, 9)), ("document", ids(100, 6)))
    chunks = plan_chunks(p, 4, NS)
    assert [(c.start, c.end) for c in chunks] == chunk_spans(p, 4)
    assert [c.num_tokens for c in chunks] == [4, 4, 1, 4, 2]
    assert all(re.fullmatch("[0-9a-f]{64}", c.key) for c in chunks)
    assert len({c.key for c in chunks}) == len(chunks)


def test_keys_are_deterministic():
    p = prompt(("text", ids(0, 9)), ("document", ids(100, 6)))
    q = prompt(("text", ids(0, 9)), ("document", ids(100, 6)))
    assert keys(p) == keys(q) == keys(p)


def test_keys_differ_with_namespace():
    p = prompt(("text", ids(0, 9)))
    other = make_namespace(model="m", tokenizer="t", dtype="bfloat16")
    assert not set(keys(p)) & set(keys(p, namespace=other))


@pytest.mark.parametrize("position", [0, 3, 8, 12])
def test_any_earlier_token_changes_every_later_key(position):
    base = ids(0, 16)
    changed = list(base)
    changed[position] = 999
    a = keys(prompt(("text", base)))
    b = keys(prompt(("text", changed)))
    first = position // 4
    assert a[:first] == b[:first]  # chunks before the change keep their keys
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_same_tokens_at_another_position_have_other_keys():
    doc = ("document", ids(100, 8))
    a = plan_chunks(prompt(("text", ids(0, 4)), doc), 4, NS)
    b = plan_chunks(prompt(("text", ids(0, 4)), ("text", ids(0, 4)), doc), 4, NS)
    assert [c.key for c in a[-2:]] != [c.key for c in b[-2:]]
    assert not {c.key for c in a[-2:]} & {c.key for c in b[-2:]}


def test_same_tokens_chunked_differently_have_other_keys():
    # identical token ids, but split into segments differently: chunk boundaries differ
    a = prompt(("text", [1, 2]), ("text", [3, 4, 5, 6]))
    b = prompt(("text", [1, 2, 3]), ("text", [4, 5, 6]))
    assert a.token_ids == b.token_ids
    assert keys(a)[-1] != keys(b)[-1]


def test_what_follows_never_changes_earlier_keys():
    prefix = ("text", ids(0, 6))
    doc = ("document", ids(100, 9))
    short = keys(prompt(prefix, doc))
    long = keys(prompt(prefix, doc, ("text", ids(300, 5))))
    assert long[: len(short)] == short
    assert len(long) > len(short)
    with_glue_doc = keys(prompt(prefix, doc, ("glue", [7, 8]), ("message", [9])))
    assert with_glue_doc[: len(short)] == short


def test_chunk_size_changes_keys():
    p = prompt(("text", ids(0, 8)))
    assert keys(p, chunk_size=4)[-1] != keys(p, chunk_size=8)[-1]


CHAT = [
    {"role": "system", "content": "You answer questions about documents. Keep answers short and exact."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog. Which animal jumps?"},
    {"role": "assistant", "content": "The fox jumps over the lazy dog."},
    {"role": "user", "content": "And which one is lazy?"},
]


def test_chat_history_keys_are_stable_across_turns():
    from helpers import tiny_tokenizer

    from kvboost_rag.canonical import Canonicalizer

    canon = Canonicalizer(tiny_tokenizer())
    later = keys(canon.canonicalize(CHAT), chunk_size=4)
    # the conversation so far, without a generation prompt: every chunk comes back in the next turn
    history = keys(canon.canonicalize(CHAT[:2], add_generation_prompt=False), chunk_size=4)
    assert later[: len(history)] == history
    # with the generation prompt, every chunk but the generation prompt's own comes back
    turn = keys(canon.canonicalize(CHAT[:2]), chunk_size=4)
    assert len(turn) > len(history) and turn[: len(history)] == history and later[: len(history)] == history


# -- content keys and namespaces -------------------------------------------------------


def test_content_key_is_position_independent():
    doc_ids = ids(100, 9)
    a = prompt(("text", ids(0, 3)), ("document", doc_ids))
    b = prompt(("text", ids(50, 11)), ("text", [7]), ("document", doc_ids), ("text", [1]))
    (sa, ea), (sb, eb) = a.segment_spans[1], b.segment_spans[2]
    ka, kb = content_key(NS, a.token_ids[sa:ea]), content_key(NS, b.token_ids[sb:eb])
    assert ka == kb == content_key(NS, tuple(doc_ids))
    # the prefix keys of the same document do differ
    assert keys(a)[-1] != keys(b)[-2]


def test_content_key_depends_on_tokens_and_namespace():
    base = content_key(NS, [1, 2, 3])
    assert content_key(NS, [1, 2, 4]) != base
    assert content_key(NS, [1, 2]) != base
    assert content_key(make_namespace(model="other"), [1, 2, 3]) != base
    # not the same digest as the prefix key of one chunk holding the same tokens
    assert base != keys(prompt(("text", [1, 2, 3])))[0]


def test_large_token_ids_are_distinguished():
    assert content_key(NS, [70000]) != content_key(NS, [70000 % 65536])
    assert keys(prompt(("text", [70000])))[0] != keys(prompt(("text", [4464])))[0]


def test_make_namespace_is_order_independent_and_sensitive_to_values():
    a = make_namespace(model="m", tokenizer="t", dtype="float32")
    b = make_namespace(dtype="float32", tokenizer="t", model="m")
    assert a == b == NS
    assert re.fullmatch("[0-9a-f]{64}", a)
    assert make_namespace(model="m", tokenizer="t", dtype="bfloat16") != a
    assert make_namespace(model="m2", tokenizer="t", dtype="float32") != a
    assert make_namespace(model="m", tokenizer="t") != a
    # keys and values are not interchangeable
    assert make_namespace(model="t", tokenizer="m", dtype="float32") != a
