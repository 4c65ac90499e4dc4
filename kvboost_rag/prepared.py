"""Request preparation: a request checked, canonicalized and fitted to the context window
(:func:`prepare_request`), and the hooks through which a running request talks to its caller.

Preparing first makes bad input fail before any work, and alone: the other requests of
a batch never see it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from .canonical import CanonicalPrompt
from .config import ReuseMode
from .core import EngineCore
from .request import Request
from .results import GenerationResult

OnDelta = Callable[[str], None]
"""Takes each piece of a request's new text, on the thread that generates it."""

Outcome = GenerationResult | BaseException


class Hooks(NamedTuple):
    """How a running request talks to its caller (each on the thread that generates it)."""

    cancel: threading.Event | None = None
    """Set by the caller: the request stops at its next layer or token."""
    on_delta: OnDelta | None = None
    """Each piece of new text as the request's tokens come out (streams)."""
    on_outcome: Callable[[Outcome], None] | None = None
    """The request's result (or error) as soon as it is known, before the rest of its batch ends."""


class Prepared(NamedTuple):
    """A request checked and canonicalized, ready to run."""

    request: Request
    canonical: CanonicalPrompt
    mode: ReuseMode
    max_new_tokens: int
    """The request's, capped by what the context window leaves."""
    submitted_at: float
    """``time.perf_counter()`` when the request came in (timings count from it)."""


def prepare_request(core: EngineCore, request: Request, submitted_at: float) -> Prepared:
    """Canonicalize a request and fit it to the context window (bad input raises here, before work)."""
    mode = request.reuse or core.config.reuse
    if mode == "blend":
        core.blend_shifter()
    canonical = core.canonicalize(request.prompt, add_generation_prompt=request.add_generation_prompt)
    core.check_window(len(canonical), 1)
    max_new = core.room_for(len(canonical), request.max_new_tokens)
    return Prepared(request, canonical, mode, max_new, submitted_at)
