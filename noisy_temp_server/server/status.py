"""`GET /v1/nts/status`: the policy in force, the estimator's and the shadow scorer's state."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from noisy_temp_server.online.policy_source import describe_policy
from noisy_temp_server.server.adapter import adapter_status
from noisy_temp_server.server.auth import require_api_key
from noisy_temp_server.server.state import ServerStateDep

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/nts/status")
async def nts_status(state: ServerStateDep) -> JSONResponse:
    """The served model, the policy new requests get (in full and described by step bucket),
    the policy source's status, the shadow scorer's (`{"enabled": false}` without one) and the
    compensation adapter's (`server.adapter.adapter_status`: its path, `none` without one)."""
    policy = state.policy_source.current_policy()
    shadow = state.shadow
    return JSONResponse(
        {
            "model": state.model_name,
            "policy": json.loads(policy.to_json()),
            **describe_policy(policy),
            "estimator": state.policy_source.status(),
            "shadow": shadow.status() if shadow is not None else {"enabled": False},
            "adapter": adapter_status(state.adapter),
        }
    )
