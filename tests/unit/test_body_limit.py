"""Request bodies over `max_request_body_bytes` get a 413 with an OpenAI error body, whether
they declare their length or come chunked; bodies within the limit reach the app intact."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from server_fakes import (
    POLICY,
    Harness,
    assert_error,
    build,
)

from noisy_temp_server.server.body_limit import BodyLimitMiddleware
from noisy_temp_server.settings import Settings

LIMIT = 4096


@pytest.fixture
def server() -> Harness:
    return build(Settings(max_request_body_bytes=LIMIT), POLICY)


def _body_of_size(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes (padded with JSON whitespace)."""
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


def _chunks(body: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _post(server: Harness, content: Any) -> Any:
    return server.client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )


def test_a_body_at_the_limit_is_served(server: Harness) -> None:
    assert _post(server, _body_of_size(LIMIT)).status_code == 200


def test_a_body_over_the_limit_is_a_413(server: Harness) -> None:
    error = assert_error(_post(server, _body_of_size(LIMIT + 1)), 413, "request_too_large")
    assert f"limit of {LIMIT} bytes" in error["message"]
    assert server.engine.calls == []
    assert server.client.get("/v1/models").status_code == 200  # and the server keeps serving


def test_a_chunked_body_is_counted_as_it_arrives(server: Harness) -> None:
    within = _post(server, _chunks(_body_of_size(LIMIT)))
    assert within.status_code == 200, within.text
    over = _post(server, _chunks(_body_of_size(10 * LIMIT)))
    assert_error(over, 413, "request_too_large")
    assert len(server.engine.calls) == 1


def test_the_limit_is_a_setting_with_a_default_of_a_few_mib() -> None:
    assert 2**20 <= Settings().max_request_body_bytes <= 16 * 2**20


def _run_middleware(messages: list[dict[str, Any]], headers: list[tuple[bytes, bytes]]) -> Any:
    """Drive the middleware with `messages` from the client; return (what the app received,
    what was sent back)."""
    received: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []
    incoming = list(messages)
    asked = 0

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, app_receive: Any, app_send: Any) -> None:
        received.append(await app_receive())
        received.append(await app_receive())

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    middleware = BodyLimitMiddleware(app, max_bytes=10)  # type: ignore[arg-type]
    asyncio.run(middleware(scope, receive, send))  # type: ignore[arg-type]
    return received, sent, asked


def test_an_over_long_declared_length_is_refused_before_reading() -> None:
    received, sent, asked = _run_middleware(
        [{"type": "http.request", "body": b"x" * 11}], [(b"content-length", b"11")]
    )
    assert received == []
    assert asked == 0
    assert sent[0]["status"] == 413


def test_a_body_within_the_limit_reaches_the_app_whole_then_the_disconnect() -> None:
    parts = [
        {"type": "http.request", "body": b"12345", "more_body": True},
        {"type": "http.request", "body": b"67890", "more_body": False},
    ]
    received, sent, _ = _run_middleware(parts, [])
    assert received == [
        {"type": "http.request", "body": b"1234567890", "more_body": False},
        {"type": "http.disconnect"},
    ]
    assert sent == []


def test_reading_stops_at_the_first_chunk_past_the_limit() -> None:
    parts = [{"type": "http.request", "body": b"123456", "more_body": True}] * 5
    received, sent, asked = _run_middleware(parts, [])
    assert received == []
    assert asked == 2
    assert sent[0]["status"] == 413
