"""ASGI middleware for the `--middleware` tests, as a user would give it by import path: a class
and an HTTP middleware coroutine function, each naming itself in a response header."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class TaggingMiddleware:
    """Adds `x-tagged-by: class` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("x-tagged-by", "class")
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tagging_function(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Adds `x-tagged-by-function: yes` to every HTTP response."""
    response = await call_next(request)
    response.headers["x-tagged-by-function"] = "yes"
    return response


NOT_MIDDLEWARE = 42
"""Neither a class nor a coroutine function."""
