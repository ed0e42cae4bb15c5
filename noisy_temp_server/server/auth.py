"""The API key check: a FastAPI dependency of every `/v1/*` route.

With `Settings.api_key` set, a request must send `Authorization: Bearer <key>` (compared in
constant time) or get a 401 OpenAI error body; without it every request is let through.
`/health` and `/metrics` never need the key (probes and scrapers do not have it).
"""

from __future__ import annotations

import secrets

from fastapi import Request

from noisy_temp_server.server.errors import OpenAIError
from noisy_temp_server.server.state import ServerStateDep

__all__ = ["require_api_key"]


async def require_api_key(request: Request, state: ServerStateDep) -> None:
    """Raise a 401 `OpenAIError` unless the request carries the configured API key. Compares
    bytes: a header is latin-1 text of any bytes (non-ASCII included), which `compare_digest`
    refuses as `str`."""
    if state.settings.api_key is None:
        return
    api_key = state.settings.api_key.get_secret_value().encode()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token_bytes = token.strip().encode("latin-1")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token_bytes, api_key):
        raise OpenAIError(
            "Incorrect or missing API key; send it as `Authorization: Bearer <key>`.",
            status_code=401,
            code="invalid_api_key",
        )
