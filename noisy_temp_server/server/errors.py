"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns has OpenAI's shape::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

with OpenAI's status codes: 400 for malformed JSON and invalid arguments (FastAPI's 422 is
mapped to 400, as OpenAI does), 401 for a missing or wrong API key, 404 for an unknown model or
route, 400 with code `context_length_exceeded` for a prompt that does not fit, 413 for a body
over the size limit, 503 (code `engine_dead`) once the engine has died, 500 for other server
faults. A handler never lets an exception escape, so one bad request cannot disturb the
others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError, VLLMNotFoundError, VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

__all__ = [
    "OpenAIError",
    "error_body",
    "install_error_handlers",
    "openai_error_from_exception",
]

_LOGGER = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error body with `status_code`."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def openai_error_from_exception(error: BaseException) -> OpenAIError:
    """Classify any exception raised while serving a request.

    vLLM's client errors (validation, not found) become 4xx with vLLM's message; a dead engine
    (`EngineDeadError`) a 503 with code `engine_dead`; an `OpenAIError` passes through; anything
    else is a 500 whose message does not leak internals (logged with its traceback).
    """
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, VLLMValidationError):
        return OpenAIError(str(error), status_code=400, param=error.parameter)
    if isinstance(error, VLLMNotFoundError):
        return OpenAIError(str(error), status_code=404)
    if isinstance(error, VLLMClientError):
        return OpenAIError(str(error), status_code=400)
    if isinstance(error, EngineDeadError):
        return OpenAIError(
            "The inference engine failed (its process died); the server is shutting down to be "
            "restarted. Retry the request shortly.",
            status_code=503,
            code="engine_dead",
        )
    _LOGGER.exception("Internal error while serving a request", exc_info=error)
    return OpenAIError(
        f"The server had an error while processing your request ({type(error).__name__}).",
        status_code=500,
        error_type="server_error",
    )


def _location(loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


def _validation_error(error: RequestValidationError) -> OpenAIError:
    details = list(error.errors())
    if any(d.get("type") == "json_invalid" for d in details) or not details:
        return OpenAIError(
            "We could not parse the JSON body of your request. The body must be a valid JSON "
            "object (check quotes and commas, and send Content-Type: application/json).",
            status_code=400,
        )
    first = details[0]
    where = _location(first.get("loc", ()))
    messages = "; ".join(
        f"{_location(d.get('loc', ())) or 'body'}: {d.get('msg', 'invalid value')}" for d in details
    )
    return OpenAIError(f"Invalid request: {messages}", status_code=400, param=where or None)


async def _handle_openai_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, OpenAIError)
    return error.response()


async def _handle_validation_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    return _validation_error(error).response()


async def _handle_http_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    status = error.status_code
    detail = error.detail if isinstance(error.detail, str) else HTTPStatus(status).phrase
    return OpenAIError(detail, status_code=status).response()


async def _handle_any_error(_: Request, error: Exception) -> JSONResponse:
    return openai_error_from_exception(error).response()


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every exception into an OpenAI error body."""
    app.add_exception_handler(OpenAIError, _handle_openai_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_error)
    app.add_exception_handler(Exception, _handle_any_error)
