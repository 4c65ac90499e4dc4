"""What the router sees of a request, and how the engine deployment is routed.

Ray Serve's ``PrefixCacheAffinityRouter`` keeps a character prefix tree of the prompts each replica
served and sends a request to the replica that served the longest prefix of its text, while the
replicas' queues stay within ``imbalanced_threshold`` of each other (past it: power-of-two choices,
so a hot prefix cannot pin every request to one replica). It reads a ``prompt`` or ``messages``
attribute from the call's first argument: :class:`Routed` carries the request's text there.

Requests of different tenants never share stored KV, so their texts are kept apart in the tree:
the text starts with a digest of the tenant's salt (never the salt itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..canonical import PromptInput, Segment
from ..request import Request

Routing = Literal["prefix", "pow2"]
"""``prefix``: prefix-cache affinity (the default); ``pow2``: Ray Serve's power-of-two choices."""

PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)
"""The class behind ``ray.serve.llm.request_router.PrefixCacheAffinityRouter``, by its own module: the
public one lives in ``ray.serve.llm``, whose import needs vLLM or SGLang, which an engine of ours
does not use."""
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
            "request_router_kwargs": {"imbalanced_threshold": imbalanced_queue},
        }
    if routing == "pow2":
        return {"request_router_class": POW2_ROUTER}
    raise ValueError(f"routing {routing!r} is not known; use 'prefix' or 'pow2'")
