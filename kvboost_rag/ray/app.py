"""The Ray Serve application: an OpenAI-compatible ingress in front of N engine replicas.

The ingress is the server of ``kvboost-rag serve`` (:func:`~kvboost_rag.server.create_app`: the same
routes, admission queue, per-request limits, API keys and tenant salts), built over a
:class:`.RemoteEngine`; the replicas are :class:`.EngineReplica`, routed by prefix affinity
(:mod:`.routing`). Layout of one application::

    HTTP -> KVBoostIngress (1 replica, no CPU reserved) -> KVBoostEngine (N replicas, routed by prefix)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from ..limits import ServerLimits
from ..server import create_app
from ..server.auth import ApiKeys
from .remote_engine import RemoteEngine
from .replica import EngineReplica, ReplicaSpec
from .routing import IMBALANCED_QUEUE, Routing, router_config

ENGINE_DEPLOYMENT = "KVBoostEngine"
INGRESS_DEPLOYMENT = "KVBoostIngress"


@dataclass(frozen=True)
class IngressOptions:
    """The server's options (those of :func:`~kvboost_rag.server.create_app`), for the ingress."""

    model_name: str
    max_queue: int = 64
    request_timeout_s: float = 120.0
    default_max_tokens: int = 256
    shutdown_grace_s: float = 30.0
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    metrics_public: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)


@serve.ingress()
class KVBoostIngress:
    """The HTTP side: the server's app over the engine deployment's handle."""

    def __init__(self, engine: DeploymentHandle, options: IngressOptions) -> None:
        self._engine, self._options = engine, options

    def __serve_build_asgi_app__(self) -> FastAPI:
        o = self._options
        return create_app(
            RemoteEngine(self._engine),  # type: ignore[arg-type]  # engine-shaped: what Service uses
            model_name=o.model_name,
            max_queue=o.max_queue,
            request_timeout_s=o.request_timeout_s,
            default_max_tokens=o.default_max_tokens,
            shutdown_grace_s=o.shutdown_grace_s,
            close_engine=False,
            api_keys=o.api_keys,
            metrics_public=o.metrics_public,
            limits=o.limits,
        )


def build_app(
    spec: ReplicaSpec,
    *,
    replicas: int = 2,
    routing: Routing = "prefix",
    imbalanced_queue: int = IMBALANCED_QUEUE,
    options: IngressOptions | None = None,
    replica_cpus: float = 1.0,
    max_ongoing_requests: int = 64,
    health_check_period_s: float = 10.0,
) -> Application:
    """The application: ``replicas`` engines loading ``spec``, behind the OpenAI ingress.

    ``imbalanced_queue``: with prefix routing, how many more requests the busiest replica may hold
    than the idlest before requests go by load rather than by prefix. ``replica_cpus``: CPUs Ray
    reserves for each engine replica (a machine takes as many replicas as it has CPUs for).
    ``max_ongoing_requests``: requests a replica takes at once (its batching scheduler runs them
    together; the router sends more elsewhere or queues them).

    >>> app = build_app(ReplicaSpec("smollm2-135m-instruct"), replicas=2)  # doctest: +SKIP
    >>> serve.run(app, name="kvboost", route_prefix="/")  # doctest: +SKIP
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1 (got {replicas})")
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=router_config(routing, imbalanced_queue),
        health_check_period_s=health_check_period_s,
        graceful_shutdown_timeout_s=(options or IngressOptions(spec.model)).shutdown_grace_s,
    )(EngineReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,  # the ingress's own admission queue answers 429 past its bound
    )(KVBoostIngress)
    return ingress.bind(engine.bind(spec), options or IngressOptions(spec.model))


def app_builder(args: dict[str, Any]) -> Application:
    """``serve run kvboost_rag.ray:app_builder model=smollm2-135m-instruct replicas=2`` or a Serve
    config file's ``import_path``: the application from plain arguments (strings on the command
    line, any JSON type in a config file).

    Arguments: ``model``, ``dtype``, ``store_dir``, ``engine`` (a mapping of EngineConfig fields),
    ``torch_threads``, ``store_secret_file``, ``replicas``, ``routing``, ``replica_cpus``,
    ``max_ongoing_requests``, ``served_model_name``, ``max_queue``, ``request_timeout_s``,
    ``default_max_tokens``, ``shutdown_grace_s``, ``api_keys_file``, ``metrics_public``.
    """
    known = {
        "model", "dtype", "store_dir", "engine", "torch_threads", "store_secret_file",
        "store_previous_secret_file", "replicas", "routing", "replica_cpus", "max_ongoing_requests",
        "served_model_name", "max_queue", "request_timeout_s", "default_max_tokens",
        "shutdown_grace_s", "api_keys_file", "metrics_public",
    }  # fmt: skip
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if "model" not in args:
        raise ValueError("model is required, e.g. model=smollm2-135m-instruct")
    threads = args.get("torch_threads")
    spec = ReplicaSpec(
        str(args["model"]),
        dtype=str(args.get("dtype", "auto")),
        store_dir=args.get("store_dir"),
        engine=dict(args.get("engine") or {}),
        torch_threads=int(threads) if threads is not None else None,
        store_secret_file=args.get("store_secret_file"),
        store_previous_secret_file=args.get("store_previous_secret_file"),
    )
    options = IngressOptions(
        model_name=str(args.get("served_model_name") or spec.model),
        max_queue=int(args.get("max_queue", 64)),
        request_timeout_s=float(args.get("request_timeout_s", 120.0)),
        default_max_tokens=int(args.get("default_max_tokens", 256)),
        shutdown_grace_s=float(args.get("shutdown_grace_s", 30.0)),
        api_keys=ApiKeys.gather((), args.get("api_keys_file")),
        metrics_public=_flag(args.get("metrics_public", False)),
    )
    return build_app(
        spec,
        replicas=int(args.get("replicas", 2)),
        routing=args.get("routing", "prefix"),
        options=options,
        replica_cpus=float(args.get("replica_cpus", 1.0)),
        max_ongoing_requests=int(args.get("max_ongoing_requests", 64)),
    )


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def engine_handle(app_name: str = "kvboost") -> DeploymentHandle:
    """A handle on the engine deployment of a running application (``kvboost``: the name that
    ``kvboost-rag serve --ray`` and ``examples/ray_serve.yaml`` give it): its ``stats``, or
    requests sent as :class:`.Routed`."""
    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name)
