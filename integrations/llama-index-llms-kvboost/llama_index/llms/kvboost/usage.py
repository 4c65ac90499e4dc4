"""KVBoostUsageHandler: per-call KV reuse of the KVBoost LLM, collected through LlamaIndex callbacks."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from llama_index.core.callbacks.base_handler import BaseCallbackHandler
from llama_index.core.callbacks.schema import CBEventType, EventPayload


@dataclass(frozen=True)
class LLMCallUsage:
    """Tokens and reuse of one LLM call (a response synthesizer may make several per query)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens read exactly from the KV store."""
    cached_tokens_by_tier: dict[str, int]
    approx_tokens: int
    recomputed_tokens: int
    ttft_s: float
    """From the call to the first generated token."""
    blended_tokens: int = 0
    """Blend mode: prompt tokens of pre-warmed nodes found and laid at their new position."""
    unused_prewarmed_tokens: int = 0
    """About how many prompt tokens of pre-warmed nodes were computed again instead of read (exact
    mode reads only the node right after the template's opening; see the engine's warning)."""


class _Total:
    """A handler attribute: the sum of the same-named field over the calls recorded so far."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, handler: KVBoostUsageHandler | None, owner: type | None = None) -> int:
        assert handler is not None, "a total of a handler instance"
        return sum(getattr(call, self.name) for call in handler.calls)


class KVBoostUsageHandler(BaseCallbackHandler):
    """Collect the token usage and KV reuse of every KVBoost call, like ``TokenCountingHandler``.

    Example:
        .. code-block:: python

            from llama_index.core import Settings
            from llama_index.core.callbacks import CallbackManager
            from llama_index.llms.kvboost import KVBoostUsageHandler

            usage = KVBoostUsageHandler()
            Settings.callback_manager = CallbackManager([usage])
            query_engine.query("...")
            usage.cached_tokens, usage.calls[-1].ttft_s
            usage.reset()
    """

    prompt_tokens = _Total()
    cached_tokens = _Total()
    approx_tokens = _Total()
    recomputed_tokens = _Total()
    blended_tokens = _Total()
    unused_prewarmed_tokens = _Total()

    def __init__(self) -> None:
        super().__init__(event_starts_to_ignore=[], event_ends_to_ignore=[])
        self._lock = threading.Lock()
        self.calls: list[LLMCallUsage] = []

    def reset(self) -> None:
        with self._lock:
            self.calls = []

    def on_event_start(
        self,
        event_type: CBEventType,
        payload: dict[str, Any] | None = None,
        event_id: str = "",
        parent_id: str = "",
        **kwargs: Any,
    ) -> str:
        return event_id

    def on_event_end(
        self,
        event_type: CBEventType,
        payload: dict[str, Any] | None = None,
        event_id: str = "",
        **kwargs: Any,
    ) -> None:
        if event_type != CBEventType.LLM or not payload:
            return
        response = payload.get(EventPayload.RESPONSE, payload.get(EventPayload.COMPLETION))
        raw = getattr(response, "raw", None)
        if not isinstance(raw, dict) or "kvboost" not in raw:
            return  # another LLM's call
        report, usage = raw["kvboost"], raw["usage"]
        call = LLMCallUsage(
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            cached_tokens=report["cached_tokens"],
            cached_tokens_by_tier=dict(report["cached_tokens_by_tier"]),
            approx_tokens=report["approx_tokens"],
            recomputed_tokens=report["recomputed_tokens"],
            ttft_s=report["ttft_s"],
            blended_tokens=report["blended_tokens"],
            unused_prewarmed_tokens=report["unused_prewarmed_tokens"],
        )
        with self._lock:
            self.calls.append(call)

    def start_trace(self, trace_id: str | None = None) -> None:
        return None

    def end_trace(self, trace_id: str | None = None, trace_map: dict[str, list[str]] | None = None) -> None:
        return None
