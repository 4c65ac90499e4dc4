"""Chunks and their keys.

A *chunk* is up to ``chunk_size`` tokens of one segment group; chunks never
cross a group boundary, so a document's chunks are the same whatever stands
before or after it. Template glue that opens a message is grouped with the
message, glue that closes one with the message before it, so a chat message's
chunks are the same in every later turn. Glue left at the very end (the
generation prompt) is a group of its own: in the next turn it opens the reply.

The *prefix key* of a chunk is SHA-256 chained over the namespace (salted per
tenant, :func:`salted`) and every chunk up to and including it: same key ⇔ same
namespace, salt, position and prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .canonical import CanonicalPrompt

KV_LAYOUT_VERSION = 2
"""Bumped whenever the stored tensor layout or the keying scheme changes."""


class Chunk(NamedTuple):
    start: int
    end: int
    key: str
    """Prefix key (hex SHA-256)."""
    parent: str = ""
    """Prefix key of the chunk before (the salted namespace for a prompt's first chunk)."""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def make_namespace(**parts: str) -> str:
    """Digest of everything a stored KV depends on besides the tokens.

    >>> make_namespace(model="m", dtype="float32") == make_namespace(dtype="float32", model="m")
    True
    """
    text = "|".join(f"{k}={parts[k]}" for k in sorted(parts))
    return hashlib.sha256(f"kvboost-kv-v{KV_LAYOUT_VERSION}|{text}".encode()).hexdigest()


def salted(namespace: str, salt: str | None) -> str:
    """The key root of one tenant: ``namespace`` itself without a salt, else a digest of both.

    Prefix and content keys start from it, so no key under one salt equals a key under another
    salt or under none: tenants neither read each other's KV nor learn by timing what is stored.

    >>> ns = make_namespace(model="m")
    >>> salted(ns, None) == ns, salted(ns, "a") == salted(ns, "a"), salted(ns, "a") == salted(ns, "b")
    (True, True, False)
    """
    if salt is None:
        return namespace
    return hashlib.sha256(
        bytes.fromhex(namespace) + b"salt" + salt.encode("utf-8", "surrogatepass")
    ).hexdigest()


def _token_bytes(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def group_spans(prompt: CanonicalPrompt) -> list[tuple[int, int]]:
    """Token spans of segment groups.

    Opening glue joins the segment after it, closing glue the group before it;
    glue left at the very end (the generation prompt) is a group of its own.
    """
    groups: list[tuple[int, int]] = []
    open_start: int | None = None  # start of opening glue waiting for its content
    for segment, (start, end) in zip(prompt.segments, prompt.segment_spans, strict=True):
        if start == end:
            continue
        if segment.kind == "closing" and groups and open_start is None:
            groups[-1] = (groups[-1][0], end)
            continue
        if open_start is None:
            open_start = start
        if segment.kind not in ("glue", "closing"):
            groups.append((open_start, end))
            open_start = None
    if open_start is not None:  # trailing glue
        groups.append((open_start, len(prompt)))
    return groups


def chunk_spans(prompt: CanonicalPrompt, chunk_size: int) -> list[tuple[int, int]]:
    """Group spans cut into pieces of at most ``chunk_size`` tokens, each group cut from its own start."""
    spans = []
    for start, end in group_spans(prompt):
        for s in range(start, end, chunk_size):
            spans.append((s, min(s + chunk_size, end)))
    return spans


def plan_chunks(prompt: CanonicalPrompt, chunk_size: int, namespace: str) -> list[Chunk]:
    """Chunks of a prompt with their chained prefix keys."""
    ids = prompt.token_ids
    parent = namespace
    chunks = []
    for start, end in chunk_spans(prompt, chunk_size):
        key = hashlib.sha256(bytes.fromhex(parent) + _token_bytes(ids[start:end])).hexdigest()
        chunks.append(Chunk(start, end, key, parent))
        parent = key
    return chunks


def content_key(namespace: str, ids: Sequence[int]) -> str:
    """Key of one segment's tokens alone, whatever its position (used by blend reuse)."""
    return hashlib.sha256(bytes.fromhex(namespace) + b"content" + _token_bytes(ids)).hexdigest()
