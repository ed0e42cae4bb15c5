"""`GET /health` and `GET /metrics`: what probes and Prometheus read (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from noisy_temp_server.server.errors import OpenAIError
from noisy_temp_server.server.state import ServerStateDep

__all__ = ["router"]

router = APIRouter()


@router.get("/health")
async def health(state: ServerStateDep) -> Response:
    """200 while the engine can serve; 503 with an OpenAI error body when it cannot."""
    try:
        await state.engine.check_health()
    except Exception as error:
        return OpenAIError(
            f"The engine cannot serve ({type(error).__name__}: {error}).", status_code=503
        ).response()
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(state: ServerStateDep) -> Response:
    """The Prometheus exposition of `ServerState.metrics_registry`."""
    return Response(generate_latest(state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
