"""The CLI's store options: the flags every command that opens a store takes, and the store
secrets, read from a file or the environment, never from a flag (the process list would show it).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import get_args

from .config import StoreCodec
from .errors import InvalidRequestError


def octal_mode(text: str) -> int:
    """File permission bits from octal text.

    >>> oct(octal_mode("640"))
    '0o640'
    """
    mode = int(text, 8)
    if not 0 <= mode <= 0o777:
        raise ValueError(f"{text} is not a file mode; pass octal permission bits such as 600 or 640")
    return mode


def add_store_args(p: argparse.ArgumentParser) -> None:
    """The store flags: secrets (as files), file mode and codec."""
    p.add_argument(
        "--store-secret-file",
        default=os.environ.get("KVBOOST_STORE_SECRET_FILE"),
        help="file holding the store secret that signs every entry and must sign every entry read "
        "(default: $KVBOOST_STORE_SECRET_FILE, else the secret itself in $KVBOOST_STORE_SECRET; "
        "none: entries are checked, not signed); every process sharing the store needs it",
    )
    p.add_argument(
        "--store-previous-secret-file",
        default=os.environ.get("KVBOOST_STORE_PREVIOUS_SECRETS_FILE"),
        help="file of earlier store secrets, one per line, whose entries are still read (never written) "
        "while a pool moves to a new secret (default: $KVBOOST_STORE_PREVIOUS_SECRETS_FILE, else the "
        "comma-separated secrets in $KVBOOST_STORE_PREVIOUS_SECRETS)",
    )
    p.add_argument(
        "--store-file-mode",
        type=octal_mode,
        default=0o600,
        help="permission bits of new store files, in octal (default: 600, directories 700; "
        "640 or 660 to share the store with a group)",
    )
    p.add_argument(
        "--store-codec",
        choices=get_args(StoreCodec),
        default="raw",
        help="how new entries are written: raw (default), zstd (lossless), int8 or int4 (approximate: "
        "counted as approx_tokens, and served only by stores that chose a lossy codec)",
    )


def store_secret(args: argparse.Namespace) -> str | None:
    """The store secret from ``--store-secret-file`` or ``$KVBOOST_STORE_SECRET`` (never a flag:
    the process list would show it)."""
    path = getattr(args, "store_secret_file", None)
    if path:
        try:
            return Path(path).expanduser().read_text(encoding="utf-8").strip()
        except OSError as e:
            msg = f"cannot read the store secret file {path!r} ({e.strerror or e})"
            raise InvalidRequestError(msg) from e
    return os.environ.get("KVBOOST_STORE_SECRET") or None


def previous_secrets(args: argparse.Namespace) -> list[str]:
    """Earlier store secrets from ``--store-previous-secret-file`` or ``$KVBOOST_STORE_PREVIOUS_SECRETS``."""
    path = getattr(args, "store_previous_secret_file", None)
    if path:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            msg = f"cannot read the previous store secrets file {path!r} ({e.strerror or e})"
            raise InvalidRequestError(msg) from e
        return [line.strip() for line in text.splitlines() if line.strip()]
    listed = os.environ.get("KVBOOST_STORE_PREVIOUS_SECRETS", "")
    return [s.strip() for s in listed.split(",") if s.strip()]


def store_secrets(args: argparse.Namespace) -> tuple[bytes, ...]:
    """Every secret a store is read with, the signing one first (none: an unsigned store)."""
    secret = store_secret(args)
    if secret is None:
        if previous_secrets(args):
            raise InvalidRequestError(
                "previous store secrets are read only next to the store secret that signs; set "
                "KVBOOST_STORE_SECRET (or --store-secret-file) to the new secret"
            )
        return ()
    return tuple(s.encode() for s in (secret, *previous_secrets(args)))
