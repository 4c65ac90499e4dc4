"""kvboost-rag on Ray Serve: one OpenAI-compatible endpoint in front of N engine replicas on one
machine or a cluster, each request routed to the replica whose memory tier holds its prefix.

Needs the ``ray`` extra (``pip install "kvboost-rag[ray]"``: Ray Serve, FastAPI and uvicorn).

>>> from kvboost_rag.ray import ReplicaSpec, build_app  # doctest: +SKIP
>>> from ray import serve  # doctest: +SKIP
>>> serve.run(build_app(ReplicaSpec("smollm2-135m-instruct"), replicas=2), route_prefix="/")  # doctest: +SKIP

From the command line: ``kvboost-rag serve --ray --replicas 2``, or ``serve run
kvboost_rag.ray:app_builder model=smollm2-135m-instruct replicas=2`` (or a Serve config file whose
``import_path`` is ``kvboost_rag.ray:app_builder``).
"""

from __future__ import annotations

try:
    import ray.serve  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installed extras
    msg = (
        f"kvboost_rag.ray needs Ray Serve ({e.name} is missing); "
        "install it with: pip install 'kvboost-rag[ray]'"
    )
    raise ImportError(msg) from e

from .app import IngressOptions, KVBoostIngress, app_builder, build_app, engine_handle
from .remote_engine import RemoteEngine
from .replica import EngineReplica, ReplicaSpec
from .routing import Routed, Routing

__all__ = [
    "EngineReplica",
    "IngressOptions",
    "KVBoostIngress",
    "RemoteEngine",
    "ReplicaSpec",
    "Routed",
    "Routing",
    "app_builder",
    "build_app",
    "engine_handle",
]
