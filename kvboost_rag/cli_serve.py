"""``kvboost-rag serve``: its flags, and the server on one process or on Ray Serve."""

from __future__ import annotations

import argparse
from typing import Any

from .cli_engine import EXIT_OK, add_model_args, add_redis_args, engine_settings, open_engine
from .cli_store import add_store_args
from .errors import InvalidRequestError
from .limits import ServerLimits


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    """The serve command's flags."""
    srv.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="alias, HF id or local path (same as --model)",
    )
    add_model_args(srv)
    srv.add_argument("--store", default=None, help="KV store directory (default: memory only)")
    add_store_args(srv)
    add_redis_args(srv)
    srv.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)"
    )
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="name /v1/models lists (default: MODEL)")
    srv.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="most requests admitted at once, running or waiting; more get 429 (default: %(default)s)",
    )
    srv.add_argument(
        "--request-timeout-s",
        type=float,
        default=120.0,
        help="per-request limit, streams included; past it 504 and the generation stops",
    )
    srv.add_argument(
        "--batch-window-ms",
        type=float,
        default=None,
        help="how long a request waits for others to join its batch (default: the engine's)",
    )
    srv.add_argument(
        "--default-max-tokens", type=int, default=256, help="max_tokens when a request sets none"
    )
    srv.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long running requests may finish before they are stopped",
    )
    srv.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key clients must send as 'Authorization: Bearer <key>' (repeatable; it shows in the "
        "process list, so prefer --api-keys-file or the KVBOOST_API_KEY environment variable)",
    )
    srv.add_argument("--api-keys-file", default=None, help="file with one API key per line")
    for option in ServerLimits.option_names():  # per-request limits: 413/400 past them
        default, flag = getattr(ServerLimits(), option), f"--{option.replace('_', '-')}"
        srv.add_argument(flag, type=int, default=default, help=ServerLimits.describe(option))
    srv.add_argument(
        "--metrics-public", action="store_true", help="serve /metrics without a key (/health always is)"
    )
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ray_group = srv.add_argument_group("Ray Serve (needs the 'ray' extra)")
    ray_group.add_argument(
        "--ray", action="store_true", help="serve N engine replicas on Ray Serve, routed by prefix affinity"
    )
    ray_group.add_argument("--replicas", type=int, default=2, help="engine replicas (default: %(default)s)")
    ray_group.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster to join ('auto', or host:port of its head); default: start one here",
    )
    ray_group.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default: %(default)s)"
    )
    ray_group.add_argument(
        "--torch-threads", type=int, default=None, help="threads of each replica's matrix products"
    )
    ray_group.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "pow2"],
        help="prefix: to the replica that served the longest prefix (default); pow2: Ray's default",
    )


def serve_command(args: argparse.Namespace) -> int:
    if args.model_arg is not None:
        args.model = args.model_arg
    if args.max_queue < 1 or args.request_timeout_s <= 0 or args.default_max_tokens < 1:
        raise InvalidRequestError(
            "--max-queue and --default-max-tokens must be >= 1, --request-timeout-s > 0"
        )
    from .server import serve
    from .server.auth import ApiKeys

    try:  # both are checked before the model loads
        keys = ApiKeys.gather(args.api_key, args.api_keys_file)
        limits = ServerLimits(**{option: getattr(args, option) for option in ServerLimits.option_names()})
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
    app_options: dict[str, Any] = {
        "model_name": args.served_model_name or args.model,
        "max_queue": args.max_queue,
        "request_timeout_s": args.request_timeout_s,
        "default_max_tokens": args.default_max_tokens,
        "shutdown_grace_s": args.shutdown_grace_s,
        "api_keys": keys,
        "metrics_public": args.metrics_public,
        "limits": limits,
    }
    if args.ray:
        return _serve_on_ray(args, app_options)
    engine = open_engine(args, args.store)
    # serve() closes the engine on shutdown (flushing pending store writes)
    serve(engine, host=args.host, port=args.port, log_level=args.log_level, **app_options)
    return EXIT_OK


def _serve_on_ray(args: argparse.Namespace, app_options: dict[str, Any]) -> int:
    """The server on Ray Serve: ``--replicas`` engines behind the OpenAI ingress, until Ctrl-C."""
    if args.replicas < 1:
        raise InvalidRequestError(f"--replicas must be >= 1 (got {args.replicas})")
    try:
        import ray
        from ray import serve

        from .ray import IngressOptions, ReplicaSpec, build_app
    except ImportError as e:
        raise InvalidRequestError(f"{e}; or serve without --ray") from e
    try:
        spec = ReplicaSpec(
            args.model,
            dtype=args.dtype,
            store_dir=args.store,
            engine=engine_settings(args),
            torch_threads=args.torch_threads,
            store_secret_file=args.store_secret_file,
            store_previous_secret_file=args.store_previous_secret_file,
        )
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
    ray.init(address=args.ray_address)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(
        spec,
        replicas=args.replicas,
        routing=args.routing,
        options=IngressOptions(**app_options),
        replica_cpus=args.replica_cpus,
    )
    try:  # until Ctrl-C; then every replica drains and closes its engine (flushing its store writes)
        serve.run(app, name="kvboost", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return EXIT_OK
