"""Document registry: registration counts each document once; persistence and sharing across instances."""

from __future__ import annotations

import pytest

from kvboost_rag.registry import MIN_DOCUMENT_CHARS, DocumentRegistry, Source

PARIS = "Paris is the capital of France. It lies on the Seine and has about two million people."
ROME = "Rome is the capital of Italy. It was founded, legend says, by Romulus in 753 BC."
OSLO = "Oslo is the capital of Norway. It sits at the head of the Oslofjord, facing south."


@pytest.fixture
def db(tmp_path):
    yield tmp_path / "registry.sqlite"


# -- registration ------------------------------------------------------------------


def test_texts_shorter_than_a_document_are_ignored():
    reg = DocumentRegistry()
    assert reg.register(["x" * (MIN_DOCUMENT_CHARS - 1), "", "short doc"]) == 0
    assert len(reg) == 0
    assert reg.register(["y" * MIN_DOCUMENT_CHARS]) == 1


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
        assert second.register([PARIS]) == 0
    finally:
        second.close()


def test_an_open_instance_sees_documents_registered_by_another(db):
    b = DocumentRegistry(db)  # opened first, sees nothing
    a = DocumentRegistry(db)
    try:
        assert len(b) == 0
        assert a.register([PARIS]) == 1
        assert len(b) == 1  # refreshed on the next look
        a.register([ROME])
        assert len(b) == 2
        b.register([OSLO])  # and the other way round
        assert len(a) == 3
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
