"""Store maintenance: integrity scans and bitwise recompute checks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .keys import Chunk
from .runner import prefill
from .store import CorruptEntryError, DiskStore

if TYPE_CHECKING:
    from .engine import KVBoostEngine


@dataclass
class VerifyReport:
    checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    """Keys whose entry failed a check (they are removed)."""
    recomputed: int = 0
    mismatched: list[str] = field(default_factory=list)
    """Keys whose stored KV differs from a fresh recompute."""
    unverifiable: int = 0
    """Sampled entries whose chain of parents is no longer complete."""

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.mismatched


def scan(store: DiskStore) -> VerifyReport:
    """Read every entry of every namespace and check it (checksum, shape, dtype, key)."""
    report = VerifyReport()
    namespaces = {key: ns for ns in store.namespaces() for key in store.keys(ns)}
    for key, ns in namespaces.items():
        report.checked += 1
        try:
            store.read_checked(key, ns)
        except CorruptEntryError:
            report.corrupt.append(key)
            store.remove(key)
    return report


def recompute_sample(engine: KVBoostEngine, store: DiskStore, sample: int, seed: int = 0) -> VerifyReport:
    """Recompute ``sample`` random entries of the engine's namespace and compare them bitwise."""
    report = VerifyReport()
    keys = list(store.keys(engine.namespace))
    for key in random.Random(seed).sample(keys, min(sample, len(keys))):
        chain = _chain(store, key, engine.namespace)
        if chain is None:
            report.unverifiable += 1
            continue
        token_ids: list[int] = []
        chunks: list[Chunk] = []
        for chunk_key, ids in chain:
            chunks.append(Chunk(len(token_ids), len(token_ids) + len(ids), chunk_key))
            token_ids.extend(ids)
        out = prefill(engine.assembler, token_ids, chunks, store=None, capacity=len(token_ids))
        fresh = engine.assembler.extract(out.cache, chunks[-1].start, chunks[-1].end)
        stored = store.read_checked(key, engine.namespace).kv
        report.recomputed += 1
        if not torch.equal(fresh.cpu(), stored):
            report.mismatched.append(key)
    return report


def _chain(store: DiskStore, key: str, namespace: str) -> list[tuple[str, tuple[int, ...]]] | None:
    """``[(key, token_ids), ...]`` from the first chunk of the prompt down to ``key``."""
    chain = []
    current: str | None = key
    while current is not None:
        try:
            entry = store.read_checked(current, namespace)
        except CorruptEntryError:
            return None
        if entry.token_ids is None:
            return None
        chain.append((current, entry.token_ids))
        current = entry.parent_key
    return chain[::-1]
