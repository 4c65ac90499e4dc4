"""The CLI's shared parts: exit statuses, the model and engine flags, and the engine they open."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .cli_store import previous_secrets, store_secret

EXIT_OK, EXIT_BAD_ENTRIES, EXIT_BAD_INPUT, EXIT_MODEL, EXIT_STORE = 0, 1, 2, 3, 4


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF id or local path")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per stored chunk (default: the engine's)"
    )


def add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("KVBOOST_REDIS_URL"),
        help="shared Redis KV tier, redis://[:password@]host:port/db or rediss:// for TLS "
        "(default: $KVBOOST_REDIS_URL; none: no Redis tier)",
    )


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the flags set (store secrets apart: see :func:`open_engine`)."""
    settings: dict[str, Any] = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    for name in ("store_file_mode", "store_codec"):  # the commands that open a store take both
        if hasattr(args, name):
            settings[name] = getattr(args, name)
    if getattr(args, "redis_url", None):
        settings["redis_url"] = args.redis_url
    if getattr(args, "batch_window_ms", None) is not None:
        settings["batch_window_ms"] = args.batch_window_ms
    return settings


def open_engine(args: argparse.Namespace, store_dir: str | None) -> Any:
    from .engine import KVBoostEngine

    overrides = engine_settings(args)
    secret = store_secret(args)
    if secret is not None:
        overrides["store_secret"] = secret
        overrides["store_previous_secrets"] = previous_secrets(args)
    return KVBoostEngine.from_pretrained(args.model, dtype=args.dtype, store_dir=store_dir, **overrides)
