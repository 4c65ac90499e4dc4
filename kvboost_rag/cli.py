"""``kvboost-rag`` command line.

Exit codes: 0 success, 1 verify found bad entries, 2 bad input or usage,
3 model not found or unsupported, 4 store cannot be used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli_engine import (
    EXIT_BAD_ENTRIES,
    EXIT_BAD_INPUT,
    EXIT_MODEL,
    EXIT_OK,
    EXIT_STORE,
    add_model_args,
    add_redis_args,
    open_engine,
)
from .cli_serve import add_serve_args, serve_command
from .cli_store import add_store_args, store_secrets
from .errors import (
    DamagedStoreError,
    InvalidRequestError,
    ModelNotFoundError,
    StoreError,
    UnsupportedModelError,
)
from .models import ALIASES, kvboost_home
from .sources import iter_documents

if TYPE_CHECKING:
    from .engine import KVBoostEngine
    from .maintenance import VerifyReport
    from .store import DiskStore


def _default_store() -> str:
    return str(kvboost_home() / "store")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost-rag", description="KV-cache reuse for local LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion (as a chat user message unless --raw)")
    gen.add_argument("prompt", help="the user message (or raw prompt with --raw); '-' reads standard input")
    add_model_args(gen)
    gen.add_argument("--store", default=None, help="KV store directory (default: memory only)")
    add_store_args(gen)
    add_redis_args(gen)
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument(
        "--reuse",
        default="exact",
        choices=["exact", "blend", "off"],
        help="exact: zero-loss reuse; blend: also reuse pre-warmed documents at new positions "
        "(approximate, reported); off: no cache",
    )
    gen.add_argument(
        "--blend-ratio",
        type=float,
        default=None,
        help="blend mode: share of reused document tokens to recompute (default: the engine's setting)",
    )
    gen.add_argument("--json", action="store_true", help="print the result with usage and timings as JSON")
    gen.add_argument("--cache-salt", default=None, help="tenant of the KV cache (default: the shared one)")

    pre = sub.add_parser("prewarm", help="compute and store the KV of documents ahead of queries")
    pre.add_argument(
        "sources", nargs="+", help="folders of .txt/.md/.rst files, JSONL files (text, id), or globs"
    )
    add_model_args(pre)
    pre.add_argument("--store", default=_default_store(), help="KV store directory (default: %(default)s)")
    add_store_args(pre)
    add_redis_args(pre)
    group = pre.add_mutually_exclusive_group()
    group.add_argument(
        "--prefix", default=None, help="for flat prompts: the exact text that precedes each document"
    )
    group.add_argument(
        "--system",
        default=None,
        help="for chat requests with this system prompt whose user message starts with a document "
        "(as 'generate --system' and the server's chat endpoint send them)",
    )
    group.add_argument(
        "--chat",
        action="store_true",
        help="for chat requests without a system message whose user message starts with a document",
    )
    pre.add_argument("--pin", action="store_true", help="never evict these documents")
    pre.add_argument(
        "--cache-salt", default=None, help="pre-warm for this tenant's requests only (default: shared)"
    )
    pre.add_argument("--quiet", action="store_true", help="no progress bar")

    stats = sub.add_parser("stats", help="entries, bytes and reads per namespace of a store")
    stats.add_argument("--store", default=_default_store())
    stats.add_argument("--json", action="store_true")

    ver = sub.add_parser("verify", help="check every entry; optionally recompute a sample bitwise")
    ver.add_argument("--store", default=_default_store())
    add_store_args(ver)
    ver.add_argument(
        "--sample", type=int, default=0, help="entries to recompute with --model and compare bitwise"
    )
    add_model_args(ver)

    gc = sub.add_parser("gc", help="drop the entries of every namespace but the given model's")
    gc.add_argument("--store", default=_default_store())
    gc.add_argument(
        "--foreign",
        action="store_true",
        help="also drop intact entries signed otherwise than this process's store secret(s) sign",
    )
    add_store_args(gc)
    add_model_args(gc)

    rep = sub.add_parser(
        "repair",
        help="rebuild damaged store databases from the entries that still check (stop other users first)",
    )
    rep.add_argument("--store", default=_default_store())
    add_store_args(rep)

    clear = sub.add_parser("clear", help="delete every entry and registered document")
    clear.add_argument("--store", default=_default_store())
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    sub.add_parser("models", help="list the offline model aliases")

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_serve_args(srv)
    return parser


def chat_prefix(engine: Any, system: str | None) -> list[Any]:
    """The segments of a chat prompt before its first user message's text (after a system message
    when given): what ``engine.prewarm`` continues with each document, as the chat template renders it."""
    from .canonical import segments_before

    marker = "\x02kvboost-documents\x03"
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": marker})
    segments = engine.canonicalizer.segments_of(messages, add_generation_prompt=False)
    return segments_before(segments, marker)


# -- commands ---------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw:
        prompt: Any = text
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]
    with open_engine(args, args.store) as engine:
        kwargs = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop=args.stop,
            reuse=args.reuse,
            blend_recompute_ratio=args.blend_ratio,
            cache_salt=args.cache_salt,
        )
        if args.json:
            r = engine.generate(prompt, **kwargs)
            out = {
                "text": r.text,
                "finish_reason": r.finish_reason,
                "usage": vars(r.usage),
                "timings": vars(r.timings),
            }
            print(json.dumps(out, indent=2))
            return EXIT_OK
        for chunk in engine.stream(prompt, **kwargs):
            print(chunk.text, end="", flush=True)
            if chunk.result is not None:
                u, t = chunk.result.usage, chunk.result.timings
                approx = f", {u.approx_tokens} blended" if u.approx_tokens else ""
                reused = f"{u.cached_tokens} reused{approx}"
                print(
                    f"\n[{u.prompt_tokens} prompt tokens, {reused}, TTFT {t.ttft_s:.3f} s]", file=sys.stderr
                )
    return EXIT_OK


def _prewarm(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    documents = list(iter_documents(args.sources))
    if not documents:
        raise InvalidRequestError("no documents found in the given sources")
    with open_engine(args, args.store) as engine:
        prefix = (
            chat_prefix(engine, args.system) if args.system is not None or args.chat else (args.prefix or "")
        )
        with tqdm(total=len(documents), unit="doc", disable=args.quiet, file=sys.stderr) as bar:
            tokens = [0]

            def progress(n: int) -> None:
                tokens[0] += n
                bar.update(1)
                bar.set_postfix(tok_per_s=f"{tokens[0] / max(bar.format_dict['elapsed'], 1e-9):.0f}")

            report = engine.prewarm(
                documents, prefix=prefix, pin=args.pin, progress=progress, cache_salt=args.cache_salt
            )
    form = "chat requests" if args.system is not None or args.chat else "flat prompts"
    print(
        f"prewarmed {report.documents} documents for {form} ({report.skipped} already stored) "
        f"into {args.store}: "
        f"{report.tokens} tokens, {report.computed_tokens} computed in {report.seconds:.1f} s "
        f"({report.tokens_per_s:.0f} tokens/s)"
    )
    return EXIT_OK


def _open_disk(store: str, secrets: tuple[bytes, ...] = ()) -> DiskStore:
    from .store import DiskStore

    if not Path(store).expanduser().is_dir():
        raise StoreError(f"no store at {store!r}; pass --store with the directory given to prewarm")
    return DiskStore(store, namespace="", background_writes=False, secret=secrets)


def _disk_tier(engine: KVBoostEngine) -> DiskStore:
    """The engine's disk tier (the engine may have a Redis tier after it)."""
    from .store import DiskStore

    for tier in engine.store.tiers:
        if isinstance(tier, DiskStore):
            return tier
    raise StoreError("the engine has no disk tier; pass --store with the directory given to prewarm")


def _stats(args: argparse.Namespace) -> int:
    from .registry import REGISTRY_DB, DocumentRegistry

    disk = _open_disk(args.store)
    try:
        spaces = disk.usage()
    finally:
        disk.close()
    registry = DocumentRegistry(Path(args.store).expanduser() / REGISTRY_DB)
    out = {
        "store": args.store,
        "entries": sum(row["entries"] for row in spaces.values()),
        "bytes": sum(row["bytes"] for row in spaces.values()),
        "documents": len(registry),
        "namespaces": spaces,
    }
    registry.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{out['store']}: {out['entries']} entries, {out['bytes'] / 2**20:.1f} MiB, "
            f"{out['documents']} registered documents"
        )
        for ns, row in out["namespaces"].items():
            print(
                f"  namespace {ns[:16]}…: {row['entries']} entries, {row['bytes'] / 2**20:.1f} MiB, "
                f"{row['reads']} reads, {row['pinned']} pinned"
            )
    return EXIT_OK


def _print_scan(report: VerifyReport) -> None:
    print(
        f"checked {report.checked} entries: {len(report.corrupt)} corrupt (removed), "
        f"{len(report.foreign)} foreign (signed otherwise; kept, 'gc --foreign' removes them), "
        f"{len(report.unreadable)} unreadable (kept; check file permissions), "
        f"{report.reindexed} re-indexed, {report.orphans} orphans removed"
    )


def _verify(args: argparse.Namespace) -> int:
    from .maintenance import recompute_sample, scan

    disk = _open_disk(args.store, store_secrets(args))
    try:
        report = scan(disk)
    finally:
        disk.close()
    _print_scan(report)
    ok = report.ok
    if args.sample:
        with open_engine(args, args.store) as engine:
            sample = recompute_sample(engine, _disk_tier(engine), args.sample)
        print(
            f"recomputed {sample.recomputed} entries: {len(sample.mismatched)} differ bitwise (removed), "
            f"{sample.unverifiable} could not be rebuilt (a parent chunk was evicted)"
        )
        ok = ok and sample.ok
    return EXIT_OK if ok else EXIT_BAD_ENTRIES


def _gc(args: argparse.Namespace) -> int:
    from .maintenance import drop_foreign

    with open_engine(args, args.store) as engine:
        disk = _disk_tier(engine)
        dropped = disk.drop_namespaces({engine.namespace})
        orphans = disk.remove_orphans()
        foreign = drop_foreign(disk) if args.foreign else 0
    print(
        f"dropped {dropped} entries of other models, dtypes or tokenizers, "
        f"and {orphans} orphans (index rows without a payload, payload files of no entry)"
        + (f", and {foreign} foreign entries (signed otherwise)" if args.foreign else "")
    )
    return EXIT_OK


def _repair(args: argparse.Namespace) -> int:
    from .maintenance import repair

    if not Path(args.store).expanduser().is_dir():
        raise StoreError(f"no store at {args.store!r}; pass --store with the store's directory")
    report = repair(args.store, secret=store_secrets(args))
    aside = ", ".join(report.set_aside) or "none"
    print(f"damaged databases set aside and rebuilt: {aside}")
    print(f"payload files stored again: {report.adopted} ({report.refused} failed their checks, removed)")
    _print_scan(report.scan)
    return EXIT_OK if not report.scan.unreadable else EXIT_BAD_ENTRIES


def _clear(args: argparse.Namespace) -> int:
    from .registry import REGISTRY_DB

    if not args.yes:
        if not sys.stdin.isatty():
            raise InvalidRequestError("refusing to clear without confirmation; pass --yes")
        if input(f"delete every entry in {args.store}? [y/N] ").strip().lower() != "y":
            return EXIT_OK
    try:
        disk = _open_disk(args.store)
    except DamagedStoreError:  # nothing to keep: delete the files themselves
        _delete_store_files(Path(args.store).expanduser())
    else:
        try:
            disk.clear()
        finally:
            disk.close()
    registry_file = Path(args.store).expanduser() / REGISTRY_DB
    for suffix in ("", "-wal", "-shm"):
        Path(str(registry_file) + suffix).unlink(missing_ok=True)
    print(f"cleared {args.store}")
    return EXIT_OK


def _delete_store_files(directory: Path) -> None:
    """Delete a store's payloads and databases by hand (when they cannot be opened)."""
    import shutil

    from .registry import REGISTRY_DB
    from .store.disk_files import INDEX_DB, PAYLOAD_DIR

    shutil.rmtree(directory / PAYLOAD_DIR, ignore_errors=True)
    for name in (INDEX_DB, REGISTRY_DB):
        for suffix in ("", "-wal", "-shm"):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)


COMMANDS = {
    "generate": _generate,
    "prewarm": _prewarm,
    "stats": _stats,
    "verify": _verify,
    "gc": _gc,
    "repair": _repair,
    "clear": _clear,
    "serve": serve_command,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "models":
            for name, spec in ALIASES.items():
                print(f"{name}\t(from PyPI: {', '.join(spec.packages)})")
            return EXIT_OK
        return COMMANDS[args.command](args)
    except (ModelNotFoundError, UnsupportedModelError) as e:
        print(f"kvboost-rag: {e}", file=sys.stderr)
        return EXIT_MODEL
    except StoreError as e:
        print(f"kvboost-rag: {e}", file=sys.stderr)
        return EXIT_STORE
    except (InvalidRequestError, ValueError) as e:
        print(f"kvboost-rag: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
