"""A limit on the size of request bodies: 413 with an OpenAI error body beyond it.

`BodyLimitMiddleware` is pure ASGI. A declared `Content-Length` over the limit is refused before
any of the body is read; otherwise (chunked bodies included, which declare no length) it reads
the body itself, counting, and refuses as soon as the count passes the limit, so a client cannot
make the server buffer more than `max_bytes`. A body within the limit reaches the app as one
`http.request` message; later `receive()` calls (the disconnect) go to the server as usual.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from noisy_temp_server.server.errors import OpenAIError

__all__ = ["BodyLimitMiddleware"]

_TOO_LARGE = 413


class _BodyTooLargeError(Exception):
    """The body (declared or read so far) is larger than the limit."""


class BodyLimitMiddleware:
    """Refuse HTTP request bodies larger than `max_bytes` with a 413."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared_length(scope)
            body, disconnected = await self._read_body(receive)
        except _BodyTooLargeError:
            await self._refuse(scope, receive, send)
            return
        await self.app(scope, _replay(body, disconnected, receive), send)

    def _check_declared_length(self, scope: Scope) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.strip().isdigit():
                if int(value) > self.max_bytes:
                    raise _BodyTooLargeError
                return

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool]:
        """The whole body, and whether the client disconnected while sending it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLargeError
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(setting max_request_body_bytes).",
            status_code=_TOO_LARGE,
            code="request_too_large",
            error_type="invalid_request_error",
        )
        await error.response()(scope, receive, send)


def _replay(body: bytes, disconnected: bool, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body first, then defers to the server's."""
    pending: list[Message] = [
        {"type": "http.disconnect"}
        if disconnected
        else {"type": "http.request", "body": body, "more_body": False}
    ]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
