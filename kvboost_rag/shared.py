"""One engine per (model, dtype, device, stores, chunk size) in a process, shared by the framework adapters.

A LangChain chat model and a LlamaIndex LLM are cheap configuration objects that
users create many of; loading weights and opening a store for each would waste
memory and split the memory tier. They fetch their engine here instead.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from .config import EngineConfig
from .engine import KVBoostEngine


class EngineSpec(NamedTuple):
    model: str
    dtype: str
    device: str | None
    store_dir: str | None
    chunk_size: int | None
    redis_url: str | None = None


_ENGINES: dict[EngineSpec, KVBoostEngine] = {}
_LOCK = threading.Lock()


def shared_engine(spec: EngineSpec) -> KVBoostEngine:
    """The process-wide engine for ``spec``, loaded on first use."""
    with _LOCK:
        engine = _ENGINES.get(spec)
        if engine is None:
            engine = KVBoostEngine.from_pretrained(
                spec.model,
                store_dir=spec.store_dir,
                dtype=spec.dtype,
                device=spec.device,
                config=EngineConfig(chunk_size=spec.chunk_size, redis_url=spec.redis_url),
            )
            _ENGINES[spec] = engine
        return engine


def close_shared_engines() -> None:
    """Close and forget every shared engine (the next use loads a fresh one)."""
    with _LOCK:
        for engine in _ENGINES.values():
            engine.close()
        _ENGINES.clear()
