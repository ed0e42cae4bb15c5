"""`GET /v1/models`: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from noisy_temp_server.server.adapter import listed_model_ids
from noisy_temp_server.server.auth import require_api_key
from noisy_temp_server.server.response_bodies import ModelCard, ModelList
from noisy_temp_server.server.state import ServerStateDep

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def list_models(state: ServerStateDep) -> ModelList:
    """The served model name (what requests must send as `model`) and its context length; on the
    LoRA path of a compensation adapter, then the base model's id (the model without it)."""
    return ModelList(
        data=[
            ModelCard(id=model_id, max_model_len=state.max_model_len)
            for model_id in listed_model_ids(state.model_name, state.adapter)
        ]
    )
