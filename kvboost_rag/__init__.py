"""kvboost-rag: exact chunk-level KV-cache reuse for local HF causal LMs.

>>> from kvboost_rag import KVBoostEngine, EngineConfig
>>> EngineConfig().reuse
'exact'
"""

from .canonical import CanonicalPrompt, Segment, normalize_text
from .config import EngineConfig
from .engine import KVBoostEngine
from .errors import (
    ContextWindowExceededError,
    InvalidRequestError,
    KVBoostError,
    MissingModelPackageError,
    ModelNotFoundError,
    StoreError,
    StreamOverflowError,
    UnsupportedModelError,
)
from .request import Request
from .results import GenerationResult, PrewarmReport, StreamChunk, Timings, Usage, WarmReport

__all__ = [
    "CanonicalPrompt",
    "ContextWindowExceededError",
    "EngineConfig",
    "GenerationResult",
    "InvalidRequestError",
    "KVBoostEngine",
    "KVBoostError",
    "MissingModelPackageError",
    "ModelNotFoundError",
    "PrewarmReport",
    "Request",
    "Segment",
    "StoreError",
    "StreamChunk",
    "StreamOverflowError",
    "UnsupportedModelError",
    "Timings",
    "Usage",
    "WarmReport",
    "normalize_text",
]
__version__ = "0.1.0"
