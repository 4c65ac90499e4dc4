"""Documents to pre-warm, from folders, files, JSONL files and glob patterns."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from .errors import InvalidRequestError

DOCUMENT_SUFFIXES = (".txt", ".md", ".rst")
"""Files a folder contributes (besides ``.jsonl``)."""


def iter_documents(sources: list[str]) -> Iterator[str]:
    """Texts from folders, JSONL files (``text`` field) and glob patterns, in a stable order."""
    for source in sources:
        path = Path(source).expanduser()
        if path.is_dir():
            wanted = (*DOCUMENT_SUFFIXES, ".jsonl")
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in wanted and p.is_file())
        elif path.is_file():
            files = [path]
        else:
            files = [Path(p) for p in sorted(glob.glob(source, recursive=True)) if Path(p).is_file()]
            if not files:
                raise InvalidRequestError(f"{source!r} is not a folder, a file or a glob that matches files")
        for file in files:
            if file.suffix.lower() == ".jsonl":
                yield from _jsonl_texts(file)
            else:
                yield file.read_text(encoding="utf-8")


def _jsonl_texts(file: Path) -> Iterator[str]:
    """The ``text`` field of each line of a JSONL file."""
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InvalidRequestError(
                    f"{file}:{n}: each JSONL line needs a JSON object with a 'text' field"
                ) from e
            if not isinstance(text, str):
                raise InvalidRequestError(f"{file}:{n}: 'text' must be a string")
            yield text
