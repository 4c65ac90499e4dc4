"""``kvboost-rag serve``: an OpenAI-compatible HTTP server over :class:`~kvboost_rag.KVBoostEngine`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
server-sent event streaming), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text). Needs the ``server`` extra
(``pip install "kvboost-rag[server]"``: FastAPI and uvicorn).

>>> from kvboost_rag import KVBoostEngine  # doctest: +SKIP
>>> from kvboost_rag.server import serve  # doctest: +SKIP
>>> serve(KVBoostEngine.from_pretrained("smollm2-135m-instruct"), port=8000)  # doctest: +SKIP
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installed extras
    msg = (
        f"the server needs FastAPI and uvicorn ({e.name} is missing); "
        "install them with: pip install 'kvboost-rag[server]'"
    )
    raise ImportError(msg) from e

from .app import create_app, create_server, serve
from .metrics import ServerMetrics

__all__ = ["ServerMetrics", "create_app", "create_server", "serve"]
