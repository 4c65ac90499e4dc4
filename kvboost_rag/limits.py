"""How much one request to the server may ask for: bounded work and memory per request.

Kept apart from :mod:`kvboost_rag.server` (which needs FastAPI) so that the command line
can list the limits as options without importing the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of ``kvboost-rag serve``; past one, a request gets 413 or 400 naming it.

    >>> ServerLimits().max_body_bytes
    4194304
    >>> ServerLimits.option_names()[:2]
    ['max_body_bytes', 'max_messages']
    """

    max_body_bytes: int = field(
        default=4 * 1024 * 1024, metadata={"help": "request body bytes (413 past it)"}
    )
    max_messages: int = field(default=1024, metadata={"help": "chat messages in one request"})
    max_content_parts: int = field(default=256, metadata={"help": "content parts in one message"})
    max_stop: int = field(default=16, metadata={"help": "stop strings in one request"})
    max_tokens_cap: int = field(default=8192, metadata={"help": "the largest max_tokens a request may ask"})

    def __post_init__(self) -> None:
        for name in self.option_names():
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def describe(cls, name: str) -> str:
        """What the limit ``name`` bounds, with its default (for ``--help``)."""
        f = next(f for f in fields(cls) if f.name == name)
        return f"{f.metadata['help']} (default: {f.default})"
