"""One engine of a Ray Serve deployment: loads the model, serves requests, reports its reuse.

Every replica loads the same model with the same engine settings (:class:`ReplicaSpec`) and opens
the shared store tiers (a disk directory on a shared filesystem, a Redis URL), so KV one replica
stores another can read. Its memory tier is its own: that is what prefix-affinity routing is for.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Final

import torch

from ..cli_store import previous_secrets, store_secret
from ..config import EngineConfig
from ..engine import KVBoostEngine
from ..results import GenerationResult, StreamChunk
from .routing import Routed

READY: Final = "ready"
"""The first item of a stream: the request was prepared (bad input raises before it)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads: the model and the engine's settings.

    ``engine`` holds :class:`~kvboost_rag.EngineConfig` fields (``chunk_size``, ``redis_url``,
    ``max_memory_bytes``, ...), checked here, before any replica starts. Store secrets do not travel
    in it: each replica reads them where it runs, from ``store_secret_file`` (a path on that node)
    or ``$KVBOOST_STORE_SECRET`` / ``$KVBOOST_STORE_SECRET_FILE``, as ``kvboost-rag serve`` does.
    ``torch_threads``: threads of each replica's matrix products (None: PyTorch's default, all
    cores; replicas sharing a machine should split its cores).

    >>> ReplicaSpec("smollm2-135m-instruct", engine={"chunk_size": 64}).engine_config().chunk_size
    64
    """

    model: str
    dtype: str = "auto"
    store_dir: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    torch_threads: int | None = None
    store_secret_file: str | None = None
    store_previous_secret_file: str | None = None

    def __post_init__(self) -> None:
        if "store_secret" in self.engine or "store_previous_secrets" in self.engine:
            raise ValueError(
                "store secrets do not travel in the replica spec; give each replica the secret in a "
                "file (store_secret_file) or in $KVBOOST_STORE_SECRET where it runs"
            )
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1 (got {self.torch_threads}); or None")
        EngineConfig.model_validate(dict(self.engine))  # bad settings fail here, not on every replica

    def engine_config(self) -> EngineConfig:
        """The engine settings, with the store secrets read where this runs (as the CLI reads them)."""
        settings = dict(self.engine)
        where = SimpleNamespace(
            store_secret_file=self.store_secret_file or os.environ.get("KVBOOST_STORE_SECRET_FILE"),
            store_previous_secret_file=self.store_previous_secret_file
            or os.environ.get("KVBOOST_STORE_PREVIOUS_SECRETS_FILE"),
        )
        secret = store_secret(where)  # type: ignore[arg-type]  # the two attributes it reads
        if secret is not None:
            settings["store_secret"] = secret
            settings["store_previous_secrets"] = previous_secrets(where)  # type: ignore[arg-type]
        return EngineConfig.model_validate(settings)

    def load(self) -> KVBoostEngine:
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        config = self.engine_config()
        return KVBoostEngine.from_pretrained(
            self.model, dtype=self.dtype, store_dir=self.store_dir, config=config
        )


class EngineReplica:
    """The body of the engine deployment (see :func:`kvboost_rag.ray.build_app`): one
    :class:`~kvboost_rag.KVBoostEngine` whose batching scheduler serves every request routed here.

    Ray Serve calls :meth:`check_health` periodically (a closed engine fails it, and the replica is
    replaced) and ``__del__`` on shutdown, which closes the engine (pending store writes are flushed).
    """

    def __init__(self, spec: ReplicaSpec) -> None:
        self.engine = spec.load()
        self._closed = False
        self._metrics = _ReuseMetrics()

    async def generate(self, routed: Routed) -> GenerationResult:
        """Answer a request whole."""
        result = await self.engine.agenerate(routed.request)
        self._metrics.record(result)
        return result

    async def stream(self, routed: Routed) -> AsyncIterator[StreamChunk | str]:
        """:data:`READY` once the request is prepared (bad input raises first), then its deltas; the
        last carries the result. A caller that goes away stops the request at its next token."""
        stream = self.engine.astream(routed.request)
        try:
            await stream.start()
            yield READY
            async for piece in stream:
                if piece.result is not None:
                    self._metrics.record(piece.result)
                yield piece
        finally:
            await stream.aclose()

    def stats(self) -> dict[str, Any]:
        """This replica's :meth:`~kvboost_rag.KVBoostEngine.stats`."""
        return self.engine.stats()

    def check_health(self) -> None:
        if self._closed:
            raise RuntimeError("the engine of this replica is closed")

    def __del__(self) -> None:
        if not self._closed and hasattr(self, "engine"):
            self._closed = True
            self.engine.close()


class _ReuseMetrics:
    """Ray metrics of this replica's reuse, tagged with the replica by Ray Serve: prompt tokens, and
    those read from each store tier."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.prompt_tokens = metrics.Counter(
            "kvboost_prompt_tokens", description="Prompt tokens of the requests this replica answered."
        )
        self.cached_tokens = metrics.Counter(
            "kvboost_cached_tokens",
            description="Prompt tokens this replica read from each store tier.",
            tag_keys=("tier",),
        )

    def record(self, result: GenerationResult) -> None:
        usage = result.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        for tier, tokens in usage.cached_tokens_by_tier.items():
            if tokens:
                self.cached_tokens.inc(tokens, tags={"tier": tier})
