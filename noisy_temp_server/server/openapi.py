"""The server's `/openapi.json`, made to say what the server really answers.

FastAPI's generated schema documents a 422 that the server never sends (validation errors are
OpenAI-style 400s, see `server.errors`), no error responses at all, `application/json` for
`/health` (an empty 200) and `/metrics` (Prometheus text), and nothing for the completion
routes, which answer JSON or server-sent events. `install_openapi` replaces `app.openapi` with
a function that fixes those, so clients and schema-driven fuzzers (`schemathesis`, see
tests/e2e/test_fuzz_openapi.py) can check every response against the document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from noisy_temp_server.server.response_bodies import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    CompletionStreamResponse,
)

__all__ = ["install_openapi"]

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS_EVERYWHERE = {
    "404": "Unknown route or model.",
    "413": "The request body is over the size limit.",
    "500": "A server fault.",
    "503": "The engine failed; the server is shutting down to be restarted.",
}
_ERRORS_OF_API_ROUTES = {"400": "Invalid request.", "401": "Missing or wrong API key."}
_UNGUARDED_WITH_BODY = ("/tokenize", "/detokenize")
"""Routes outside `/v1/` (no API key, as vLLM's server) that validate a body."""
_JSON_OR_EVENTS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionResponse, CompletionStreamResponse),
    "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionChunk),
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
    }


def _event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event: a chunk, an error after the 200 (in-band), or `[DONE]`."""
    payload = {
        "anyOf": [{"$ref": _REF.format(model=name)} for name in (chunk.__name__, "ErrorResponse")]
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "anyOf": [
                    {"const": "[DONE]"},
                    {"contentMediaType": "application/json", "contentSchema": payload},
                ],
            }
        },
    }


def _fix_operation(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation["responses"]
    responses.pop("422", None)
    errors = dict(_ERRORS_EVERYWHERE)
    if path.startswith("/v1/"):
        errors |= _ERRORS_OF_API_ROUTES
    elif path in _UNGUARDED_WITH_BODY:
        errors["400"] = _ERRORS_OF_API_ROUTES["400"]
    if path in _JSON_OR_EVENTS:
        responses["499"] = {"description": "The client disconnected first (no body)."}
        response, chunk = _JSON_OR_EVENTS[path]
        responses["200"]["content"] = {
            "application/json": {"schema": {"$ref": _REF.format(model=response.__name__)}},
            "text/event-stream": {"schema": _event_schema(chunk)},
        }
    elif path == "/health":
        responses["200"] = {"description": "The engine serves (empty body)."}
    elif path == "/metrics":
        text = {"schema": {"type": "string"}}
        responses["200"]["content"] = {"text/plain": text}
    for status, description in errors.items():
        responses.setdefault(status, _error(description))


def _response_schemas(models: list[type[BaseModel]]) -> dict[str, Any]:
    _, schema = models_json_schema(
        [(model, "serialization") for model in models], ref_template=_REF
    )
    return dict(schema.get("$defs", {}))


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with the corrected schema (built once, on first use)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                _fix_operation(path, operation)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components |= _response_schemas([m for pair in _JSON_OR_EVENTS.values() for m in pair])
        components["ErrorResponse"] = _ERROR_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
