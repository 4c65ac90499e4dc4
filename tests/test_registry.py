"""Document registry: exact, leftmost, longest, non-overlapping matches; persistence across instances."""

from __future__ import annotations

import pytest

from kvboost_rag.registry import ANCHOR_CHARS, DocumentRegistry, Match, Source

PARIS = "Paris is the capital of France. It lies on the Seine and has about two million people."
ROME = "Rome is the capital of Italy. It was founded, legend says, by Romulus in 753 BC."
OSLO = "Oslo is the capital of Norway. It sits at the head of the Oslofjord, facing south."


def found(reg: DocumentRegistry, text: str) -> list[str]:
    return [text[m.start : m.end] for m in reg.find(text)]


@pytest.fixture
def reg():
    r = DocumentRegistry()
    r.register([PARIS, ROME, OSLO])
    yield r
    r.close()


@pytest.fixture
def db(tmp_path):
    yield tmp_path / "registry.sqlite"


# -- matching -------------------------------------------------------------------


def test_finds_a_document_inside_a_flat_prompt(reg):
    text = "Context:\n" + ROME + "\n\nQuestion: who founded Rome?"
    matches = reg.find(text)
    assert matches == [Match(9, 9 + len(ROME))]
    assert found(reg, text) == [ROME]


def test_documents_are_found_in_prompt_order(reg):
    text = "A: " + OSLO + " B: " + PARIS + " C: " + ROME + " D: " + OSLO
    assert found(reg, text) == [OSLO, PARIS, ROME, OSLO]
    starts = [m.start for m in reg.find(text)]
    assert starts == sorted(starts)


def test_adjacent_documents_without_separator(reg):
    text = PARIS + ROME
    assert reg.find(text) == [Match(0, len(PARIS)), Match(len(PARIS), len(PARIS) + len(ROME))]


def test_whole_text_is_a_document(reg):
    assert reg.find(PARIS) == [Match(0, len(PARIS))]


@pytest.mark.parametrize(
    "where", [0, ANCHOR_CHARS - 1, ANCHOR_CHARS, 50, len(PARIS) - 1], ids=lambda i: f"char{i}"
)
def test_one_changed_character_is_not_found(reg, where):
    changed = PARIS[:where] + ("#" if PARIS[where] != "#" else "%") + PARIS[where + 1 :]
    assert changed != PARIS
    text = "Context: " + changed + " Question?"
    assert reg.find(text) == []


def test_case_and_whitespace_differences_are_not_found(reg):
    assert reg.find("Context: " + PARIS.upper()) == []
    assert reg.find("Context: " + PARIS.replace(" ", "  ", 1)) == []
    assert reg.find("Context: " + PARIS.replace(" ", "\u00a0", 1)) == []


def test_a_document_cut_short_is_not_found(reg):
    assert reg.find("Context: " + PARIS[:-1]) == []
    assert reg.find(PARIS[: ANCHOR_CHARS + 5]) == []


def test_unregistered_text_and_short_text(reg):
    assert reg.find("") == []
    assert reg.find("short") == []
    assert reg.find("x" * 500) == []


def test_leftmost_match_wins_over_an_overlapping_later_one():
    shared = "the shared middle part of both documents, long enough to anchor on. "
    first = "First document begins here. " + shared
    second = shared + "Second document ends here."
    reg = DocumentRegistry()
    assert reg.register([first, second]) == 2
    text = "First document begins here. " + shared + "Second document ends here."
    # both occur, overlapping: only the leftmost is taken, the other is not cut in pieces
    assert found(reg, text) == [first]
    # on its own, the second is found
    assert found(reg, "xx " + second) == [second]


def test_non_overlapping_matches_after_an_overlap_are_still_found():
    shared = "the shared middle part of both documents, long enough to anchor on. "
    first = "First document begins here. " + shared
    second = shared + "Second document ends here."
    reg = DocumentRegistry()
    reg.register([first, second, ROME])
    text = first + "Second document ends here. then " + ROME + " and " + second
    assert found(reg, text) == [first, ROME, second]


def test_longest_document_wins_at_one_position():
    short = PARIS
    long = PARIS + " More about Paris: the Louvre, the Eiffel Tower and many bridges."
    reg = DocumentRegistry()
    assert reg.register([short, long]) == 2
    assert found(reg, "Q: " + long + " end") == [long]
    # where only the short one fits, it is found
    assert found(reg, "Q: " + short + " Something else entirely, not the long one.") == [short]
    # registration order does not matter
    reg2 = DocumentRegistry()
    reg2.register([long, short])
    assert found(reg2, "Q: " + long + " end") == [long]


def test_a_document_inside_another_is_not_found_inside_the_match():
    inner = ROME
    outer = "Introduction to the outer document. " + inner + " Closing words of it."
    reg = DocumentRegistry()
    reg.register([inner, outer])
    assert found(reg, outer) == [outer]
    assert found(reg, "x " + inner) == [inner]


def test_documents_sharing_a_long_prefix_are_told_apart():
    prefix = "A" * ANCHOR_CHARS + " common opening shared by both: "
    a, b = prefix + "then it goes one way.", prefix + "and then it goes another."
    reg = DocumentRegistry()
    reg.register([a, b])
    assert found(reg, "1 " + a + " 2 " + b) == [a, b]
    assert found(reg, prefix + "and neither.") == []


# -- registration ------------------------------------------------------------------


def test_documents_shorter_than_the_anchor_are_ignored():
    reg = DocumentRegistry()
    tiny = "x" * (ANCHOR_CHARS - 1)
    exact = "y" * ANCHOR_CHARS
    assert reg.register([tiny, "", "short doc"]) == 0
    assert len(reg) == 0
    assert reg.find("before " + tiny + " after") == []
    assert reg.register([exact]) == 1
    assert found(reg, "before " + exact + " after") == [exact]


def test_register_counts_only_new_documents():
    reg = DocumentRegistry()
    assert reg.register([PARIS, ROME, PARIS]) == 2  # duplicate within one call
    assert reg.register([PARIS]) == 0
    assert reg.register([ROME, OSLO]) == 1
    assert reg.register([]) == 0
    assert reg.register(iter([OSLO, OSLO])) == 0  # any iterable
    assert len(reg) == 3


def test_register_counts_only_new_documents_when_persisted(db):
    reg = DocumentRegistry(db)
    try:
        assert reg.register([PARIS, ROME, PARIS]) == 2
        assert reg.register([ROME, OSLO]) == 1
        assert len(reg) == 3
    finally:
        reg.close()


# -- persistence ------------------------------------------------------------------


def test_documents_persist_across_instances(db):
    first = DocumentRegistry(db)
    first.register([PARIS, ROME])
    first.close()
    second = DocumentRegistry(db)
    try:
        assert len(second) == 2
        assert found(second, "x " + ROME + " y " + PARIS) == [ROME, PARIS]
        assert second.register([PARIS]) == 0
    finally:
        second.close()


def test_an_open_instance_sees_documents_registered_by_another(db):
    b = DocumentRegistry(db)  # opened first, sees nothing
    a = DocumentRegistry(db)
    try:
        assert b.find("x " + PARIS) == []
        assert a.register([PARIS]) == 1
        assert found(b, "x " + PARIS) == [PARIS]  # refreshed on the next find
        a.register([ROME])
        assert found(b, PARIS + ROME) == [PARIS, ROME]
        assert len(b) == 2
        # and the other way round
        b.register([OSLO])
        assert found(a, "x " + OSLO) == [OSLO]
    finally:
        a.close()
        b.close()


def test_register_does_not_count_documents_another_instance_registered(db):
    b = DocumentRegistry(db)
    a = DocumentRegistry(db)
    try:
        assert a.register([PARIS]) == 1
        assert b.register([PARIS]) == 0
    finally:
        a.close()
        b.close()


def test_in_memory_registries_are_independent():
    a, b = DocumentRegistry(), DocumentRegistry()
    a.register([PARIS])
    assert b.find(PARIS) == []
    assert len(b) == 0


def test_close_is_idempotent(db):
    reg = DocumentRegistry(db)
    reg.register([PARIS])
    reg.close()
    reg.close()


def test_may_have_sources_sees_records_of_another_process(tmp_path):
    path = tmp_path / "registry.sqlite"
    reader, writer = DocumentRegistry(path), DocumentRegistry(path)
    assert not reader.may_have_sources() and not DocumentRegistry().may_have_sources()
    writer.add_sources({"c": Source("p", 0)})
    assert reader.may_have_sources() and writer.may_have_sources()
