"""RedisRecords: the registry's shared records, over the Redis tier's public record methods only.

A fake tier stands in for Redis here (the real one is exercised in test_redis.py), which also
shows how narrow the records' use of the store is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvboost_rag.registry import MIN_DOCUMENT_CHARS, Source
from kvboost_rag.store.redis_records import RedisRecords

LONG = "x" * MIN_DOCUMENT_CHARS


class FakeTier:
    """The record methods of :class:`~kvboost_rag.store.redis.RedisStore`, in memory."""

    def __init__(self) -> None:
        self.registry_refresh_s = 0.0
        self.documents: list[str] = []
        self.recorded: dict[str, Source] = {}
        self.away = False
        self.reads = 0

    def add_documents(self, texts: Sequence[str]) -> None:
        self.documents.extend(t for t in texts if t not in self.documents)

    def documents_from(self, start: int) -> tuple[int, list[str]] | None:
        self.reads += 1
        return None if self.away else (len(self.documents[start:]), self.documents[start:])

    def add_sources(self, sources: Mapping[str, Source]) -> None:
        self.recorded.update(sources)

    def sources(self, content_keys: Sequence[str]) -> dict[str, Source]:
        return {} if self.away else {k: self.recorded[k] for k in content_keys if k in self.recorded}


def test_documents_are_published_once_and_short_ones_never():
    tier = FakeTier()
    records = RedisRecords(tier)  # type: ignore[arg-type]
    records.publish_documents([LONG + "a", "short", LONG + "a", LONG + "b"])
    records.publish_documents([])
    assert tier.documents == [LONG + "a", LONG + "b"]


def test_new_documents_are_read_from_where_the_last_read_stopped():
    tier = FakeTier()
    records = RedisRecords(tier)  # type: ignore[arg-type]
    tier.add_documents([LONG + "1"])
    assert records.new_documents() == [LONG + "1"]
    assert records.new_documents() == []
    tier.add_documents([LONG + "2"])
    tier.away = True
    assert records.new_documents() == []  # Redis away: nothing, and the position is kept
    tier.away = False
    assert records.new_documents() == [LONG + "2"]


def test_polls_are_spaced_by_the_refresh_period():
    tier = FakeTier()
    tier.registry_refresh_s = 3600.0
    records = RedisRecords(tier)  # type: ignore[arg-type]
    records.new_documents()
    tier.add_documents([LONG])
    assert records.new_documents() == [] and tier.reads == 1


def test_sources_pass_through():
    tier = FakeTier()
    records = RedisRecords(tier)  # type: ignore[arg-type]
    records.publish_sources({})
    records.publish_sources({"c1": Source("p1", 16)})
    assert records.sources(["c1", "c2"]) == {"c1": Source("p1", 16)}
