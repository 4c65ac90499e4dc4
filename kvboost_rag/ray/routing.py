"""What the router sees of a request, and how the engine deployment is routed.

Ray Serve's ``PrefixCacheAffinityRouter`` keeps a character prefix tree of the prompts each replica
served and sends a request to the replica that served the longest prefix of its text (a new prefix
to the replica holding the least text). It reads a ``prompt`` or ``messages`` attribute from the
call's first argument: :class:`Routed` carries the request's text there. Its own load bound
(``imbalanced_threshold``) reads queue lengths that lag a burst: ten requests 0.1 s apart on one
hot prefix, each decoding 1.5 s, all went to one replica with the bound at 0. So
:class:`BoundedPrefixRouter` keeps the bound itself, from the requests it has in flight on each
replica: past ``imbalanced_queue``, a request goes to the least loaded replica, whatever it matches.

Requests of different tenants never share stored KV, so their texts are kept apart in the tree:
the text starts with a digest of the tenant's salt (never the salt itself).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from ..canonical import PromptInput, Segment
from ..request import Request

Routing = Literal["prefix", "pow2"]
"""``prefix``: prefix-cache affinity (the default); ``pow2``: Ray Serve's power-of-two choices."""

PREFIX_ROUTER = "kvboost_rag.ray.routing:BoundedPrefixRouter"
POW2_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"

IMBALANCED_QUEUE = 3
"""Past this difference between the longest and the shortest replica queue, requests go by load
(power of two) rather than by prefix. A replica batches the requests it holds, so a few more on the
replica that holds their prefix cost less than reading it elsewhere (``benchmarks/ray_routing.py``
with a shared disk tier: a gap of 1 left 40-43 % of prompt tokens read from memory and 24-27 % from
disk; a gap of 3, 54-61 % and 9-16 %); the router's own default (no limit) would let one hot prefix
take every request."""


@dataclass(frozen=True)
class Routed:
    """A request as it travels to an engine replica: ``prompt`` is the text the router matches."""

    prompt: str
    request: Request

    @classmethod
    def of(cls, request: Request) -> Routed:
        """The request with its routing text: the prompt's text in order, after the tenant's digest.

        >>> Routed.of(Request([Segment("Docs."), Segment("Q?")])).prompt
        'Docs.\\nQ?'
        """
        text = prompt_text(request.prompt)
        if request.cache_salt is not None:
            digest = hashlib.sha256(request.cache_salt.encode()).hexdigest()[:16]
            text = f"tenant {digest}\n{text}"
        return cls(text, request)


def prompt_text(prompt: PromptInput) -> str:
    """The text of a prompt in the order the model reads it (one line break between parts)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(_part_text(part) for part in prompt)


def _part_text(part: str | Segment | Mapping[str, Any]) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Segment):
        return part.text
    content = part.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    return ""


def router_config(routing: Routing, imbalanced_queue: int = IMBALANCED_QUEUE) -> dict[str, Any]:
    """The deployment's ``request_router_config`` for ``routing``."""
    if routing == "prefix":
        return {
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {"imbalanced_queue": imbalanced_queue},
        }
    if routing == "pow2":
        return {"request_router_class": POW2_ROUTER}
    raise ValueError(f"routing {routing!r} is not known; use 'prefix' or 'pow2'")


class BoundedPrefixRouter(PrefixCacheAffinityRouter):
    """Ray Serve's ``PrefixCacheAffinityRouter`` (imported from its defining module: the public
    ``ray.serve.llm`` path needs vLLM or SGLang, which an engine of ours does not use), with the load
    bound kept from the requests this router has sent to each replica and not seen end."""

    def initialize_state(self, imbalanced_queue: int = IMBALANCED_QUEUE, **kwargs: Any) -> None:  # type: ignore[override]
        super().initialize_state(**kwargs)  # its own bound stays off: this one decides
        self._bound = imbalanced_queue
        self._in_flight: dict[ReplicaID, int] = {}
        self._lock = threading.Lock()  # results end on other threads

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> Any:
        """Groups of replicas to try in order (Ray Serve takes the shortest queue of a group)."""
        with self._lock:
            loads = [self._in_flight.get(r.replica_id, 0) for r in candidate_replicas]
        if loads and max(loads) - min(loads) > self._bound:
            return [[r for r, load in zip(candidate_replicas, loads, strict=True) if load == min(loads)]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # counted when sent, not when the replica confirms: a busy replica confirms late, and a
        # burst would all be routed before the first confirmation
        super().on_send_request(replica_id)
        with self._lock:
            self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        super().decrement_queue_len_cache(replica_id)  # a request sent there ended
        with self._lock:
            self._in_flight[replica_id] = max(self._in_flight.get(replica_id, 0) - 1, 0)
