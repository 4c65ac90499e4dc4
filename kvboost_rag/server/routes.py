"""The HTTP endpoints, on an :class:`~fastapi.APIRouter`; each reaches the app's
:class:`~kvboost_rag.server.service.Service` through the ``service`` dependency (``app.state.kvboost``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..canonical import PromptInput
from ..errors import InvalidRequestError
from .auth import TENANT_STATE
from .errors import error_response
from .metrics import CONTENT_TYPE
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_limits,
    completion_prompt,
    error_body,
    to_request,
)
from .service import Kind, Service

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/models", "/health", "/metrics")
"""Every path served; the metrics label requests with these (and ``other``)."""


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a request path: one of :data:`ENDPOINTS`, or ``other``.

    >>> endpoint_label("/v1/models/tiny"), endpoint_label("/favicon.ico")
    ('/v1/models', 'other')
    """
    if path in ENDPOINTS:
        return path
    return "/v1/models" if path.startswith("/v1/models/") else "other"


def get_service(http: HTTPRequest) -> Service:
    """The app's service (set by :func:`~kvboost_rag.server.create_app`)."""
    service: Service = http.app.state.kvboost
    return service


ServiceDep = Annotated[Service, Depends(get_service)]

router = APIRouter()


async def _generate(
    service: Service,
    http: HTTPRequest,
    kind: Kind,
    body: ChatCompletionRequest | CompletionRequest,
    prompt: Callable[[], PromptInput],
) -> Response:
    """Check the body, build the engine request and serve it; ``prompt`` runs inside the check so
    its refusals are answered like those of the settings (a 400 naming the field)."""
    try:
        check_limits(body, http.app.state.limits)
        tenant = getattr(http.state, TENANT_STATE, None)  # set by the API key middleware
        request = to_request(body, prompt(), service.default_max_tokens, tenant)
    except InvalidRequestError as e:  # BadRequest names the field; Request's own checks do not
        return error_response(e)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await service.generate(http, kind, request, stream=bool(body.stream), include_usage=include_usage)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest, service: ServiceDep) -> Response:
    """OpenAI chat completions; each message (and each text part) is a segment of its own."""
    return await _generate(service, http, "chat", body, lambda: chat_messages(body))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HTTPRequest, service: ServiceDep) -> Response:
    """OpenAI (legacy) completions: the prompt is used as is, without a chat template."""
    return await _generate(service, http, "completion", body, lambda: completion_prompt(body))


def _model_card(service: Service) -> dict[str, Any]:
    return {
        "id": service.model_name,
        "object": "model",
        "created": service.created,
        "owned_by": "kvboost-rag",
    }


@router.get("/v1/models")
async def models(service: ServiceDep) -> dict[str, Any]:
    """The one model this server serves."""
    return {"object": "list", "data": [_model_card(service)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, service: ServiceDep) -> Response:
    """The served model's card; 404 for any other name."""
    if model_id != service.model_name:
        msg = f"model {model_id!r} is not served here; this server serves {service.model_name!r}"
        return JSONResponse(
            error_body(msg, "invalid_request_error", "model", "model_not_found"), status_code=404
        )
    return JSONResponse(_model_card(service))


@router.get("/health")
async def health(service: ServiceDep) -> JSONResponse:
    """Liveness and load; 503 once the server drains, so load balancers send traffic elsewhere."""
    a = service.admission
    body = {
        "status": "shutting_down" if a.draining else "ok",
        "model": service.model_name,
        "in_flight": len(a.tickets),
        "queue_depth": a.waiting,
        "max_queue": a.capacity,
    }
    return JSONResponse(body, status_code=503 if a.draining else 200)


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    """Prometheus text: requests, tokens, latencies, the queue and the store's tiers."""
    store = None
    if not service.closed:
        try:  # the disk tier counts its entries in SQLite: off the loop
            store = await asyncio.to_thread(service.engine.stats)
        except Exception:  # metrics must not fail because a tier cannot be read right now
            logger.warning("engine.stats() failed; /metrics leaves the store families out", exc_info=True)
    a = service.admission
    text = service.metrics.render(
        in_flight=len(a.tickets), waiting=a.waiting, draining=a.draining, store=store
    )
    return Response(text, media_type=CONTENT_TYPE)
