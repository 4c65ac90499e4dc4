"""What a finished request leaves for the request after it: its chat reply stored as the next
turn will render it (``EngineConfig.store_replies``), and its cache held for a request that
continues it (:mod:`.held_context`). Alone or batched, a request ends through the same calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from transformers.cache_utils import Cache

from .assembler.buffered_cache import BufferedCache
from .canonical import is_messages
from .core import EngineCore
from .followups import FollowUps
from .keys import salted
from .prepared import Prepared
from .results import GenerationResult
from .runner import PrefillOutcome
from .warming import store_reply, store_reply_from_cache


class NextTurn:
    """Stores replies and holds caches for the requests that follow; replies that cannot be stored
    at once are queued on ``followups``."""

    def __init__(self, core: EngineCore, followups: FollowUps) -> None:
        self.core = core
        self.followups = followups

    def stores_reply(self, prepared: Prepared) -> bool:
        """Whether the request's reply is stored for the next turn (see ``EngineConfig.store_replies``)."""
        request = prepared.request
        return (
            prepared.mode == "exact"
            and self.core.config.store_replies
            and is_messages(request.prompt)
            and request.add_generation_prompt
        )

    def store_reply_now(self, prepared: Prepared, text: str, cache: Cache, cache_ids: Sequence[int]) -> bool:
        """Store the reply's chunks from the request's own ``cache`` (KV with a prefill's bits for
        ``cache_ids``), before the answer returns, so a call that follows at once reads them; True
        when that stored the whole reply (no background re-prefill needed)."""
        if not self.stores_reply(prepared):
            return True  # nothing to store
        messages = cast("Sequence[Mapping[str, Any]]", prepared.request.prompt)
        salt = prepared.request.cache_salt
        return store_reply_from_cache(self.core, messages, text, salt, cache, cache_ids)

    def hold(
        self, prepared: Prepared, prefill: PrefillOutcome | None, cache: Cache, cache_ids: Sequence[int]
    ) -> None:
        """Keep an exact request's ``cache`` (KV with a prefill's bits for ``cache_ids``) for a request
        that continues it (:mod:`.held_context`); KV from a lossy store codec is never held."""
        if prepared.mode != "exact" or prefill is None or prefill.approx_tokens:
            return
        if isinstance(cache, BufferedCache):
            namespace = salted(self.core.namespace, prepared.request.cache_salt)
            self.core.held.keep(namespace, cache_ids, cache)

    def follow_up(self, prepared: Prepared, result: GenerationResult) -> None:
        """Queue storing a chat reply as the next turn will render it, by a re-prefill once the
        engine is idle (see ``EngineConfig.store_replies``): for replies whose KV does not have a
        prefill's bits (batched rows, the canonical schedule), or that the template renders otherwise
        than the tokens generated."""
        if not self.stores_reply(prepared):
            return
        messages = prepared.request.prompt
        salt = prepared.request.cache_salt  # the reply is the tenant's too
        self.followups.submit(lambda: store_reply(self.core, messages, result.text, salt))  # type: ignore[arg-type]
