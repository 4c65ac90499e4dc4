"""What the framework adapters share: one engine per process and spec, and how a call becomes a request.

A LangChain chat model and a LlamaIndex LLM are cheap configuration objects that
users create many of; loading weights and opening a store for each would waste
memory and split the memory tier. They fetch their engine here instead.
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping, Sequence
from typing import Any, NamedTuple

from .config import EngineConfig
from .engine import KVBoostEngine
from .request import SETTINGS, Request


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


def request_for(
    prompt: Any, defaults: object, options: MutableMapping[str, Any], *, stop: Sequence[str] | None = None
) -> Request:
    """The request of one adapter call.

    Each setting comes from ``options`` (the call's keyword arguments; the ones used are
    removed, so the caller sees what is left unused), else from the same-named attribute of
    ``defaults`` (the adapter's fields). ``max_tokens`` stands for ``max_new_tokens`` in both.
    Stop strings add up: the adapter's, ``stop``, then the call's.

    >>> class Defaults: temperature, max_tokens, stop = 0.0, 32, ["END"]
    >>> r = request_for("Hi", Defaults(), {"temperature": 0.7, "stop": "STOP", "n": 2})
    >>> r.temperature, r.max_new_tokens, r.stop
    (0.7, 32, ('END', 'STOP'))
    """
    settings = {name: getattr(defaults, name) for name in SETTINGS if hasattr(defaults, name)}
    if hasattr(defaults, "max_tokens"):
        settings["max_new_tokens"] = defaults.max_tokens
    if "max_tokens" in options:
        options["max_new_tokens"] = options.pop("max_tokens")
    stops = [*_strings(settings.pop("stop", None)), *(stop or []), *_strings(options.pop("stop", None))]
    settings |= {name: options.pop(name) for name in SETTINGS if name in options}
    return Request(prompt, **settings | {"stop": stops})


def _strings(value: str | Sequence[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)
