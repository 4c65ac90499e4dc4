"""The only package that touches transformers' Cache API and model forward.

:class:`Assembler` lays stored chunks into a cache, runs new tokens through the model over
that cache, and cuts the KV of freshly computed chunks back out; :mod:`.buffered_cache` is the
cache it runs over.
"""

from .assembler import Assembler

__all__ = ["Assembler"]
