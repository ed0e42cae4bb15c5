"""A dead engine: requests in flight get a 503 with code `engine_dead` (in-band once a stream
has started), `/health` answers 503, and `EngineWatchedServer` shuts the HTTP server down within
a bounded time and records why (so `serve` exits 1). With a fake engine; the real engine core is
killed in tests/e2e/test_engine_fault.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Response
from server_fakes import (
    POLICY,
    FakeEngine,
    assert_error,
    build,
    sse_events,
)
from vllm.v1.engine.exceptions import EngineDeadError

from noisy_temp_server.server.engine_watchdog import EngineWatchedServer
from noisy_temp_server.settings import Settings


class DyingEngine(FakeEngine):
    """Dies (as vLLM's AsyncLLM does when its engine core process dies) after `outputs_left`
    outputs."""

    def __init__(self, outputs_left: int) -> None:
        super().__init__()
        self.outputs_left = outputs_left

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        async for output in super().generate(*args, **kwargs):
            if self.outputs_left <= 0:
                self.dead = True
            if self.dead:
                raise EngineDeadError()
            self.outputs_left -= 1
            yield output

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError()


def _dying_harness(outputs_left: int) -> Any:
    harness = build(Settings(), POLICY)
    engine = DyingEngine(outputs_left)
    harness.engine.generate = engine.generate  # type: ignore[method-assign]
    harness.engine.check_health = engine.check_health  # type: ignore[method-assign]
    return harness, engine


def test_a_request_in_flight_gets_a_503_saying_the_engine_failed() -> None:
    harness, _ = _dying_harness(outputs_left=0)
    error = assert_error(harness.post("/v1/completions", {"prompt": "ab", "max_tokens": 4}), 503)
    assert error["code"] == "engine_dead"
    assert error["type"] == "service_unavailable_error"
    assert "engine failed" in error["message"]
    assert harness.client.get("/health").status_code == 503


def test_a_stream_in_flight_gets_the_error_in_band() -> None:
    harness, _ = _dying_harness(outputs_left=2)
    body = {"prompt": "ab", "max_tokens": 6, "stream": True}
    response = harness.post("/v1/completions", body)
    assert response.status_code == 200
    events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_dead"
    assert sum(1 for e in events[:-2] if e.get("choices")) == 2


def test_a_new_request_after_the_death_gets_a_503() -> None:
    harness, engine = _dying_harness(outputs_left=0)
    engine.dead = True
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    error = assert_error(harness.post("/v1/chat/completions", body), 503)
    assert error["code"] == "engine_dead"


async def _serve_until_done(server: EngineWatchedServer, kill_after_s: float | None) -> float:
    engine: Any = server._engine
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    if kill_after_s is None:
        server.should_exit = True
    else:
        await asyncio.sleep(kill_after_s)
        engine.dead = True
    await asyncio.wait_for(task, timeout=30)
    return time.monotonic() - started


def _server(engine: FakeEngine, **kwargs: Any) -> EngineWatchedServer:
    config = uvicorn.Config(FastAPI(), host="127.0.0.1", port=0, log_level="warning")
    return EngineWatchedServer(config, engine, **kwargs)


def test_the_watchdog_shuts_the_server_down_when_the_engine_dies() -> None:
    server = _server(DyingEngine(0), interval_s=0.05, drain_s=0.1, grace_s=5.0)
    elapsed = asyncio.run(_serve_until_done(server, kill_after_s=0.2))
    assert isinstance(server.engine_failure, EngineDeadError)
    assert elapsed < 5.0  # nothing lingered: no need for the forced exit


def test_a_normal_shutdown_records_no_engine_failure() -> None:
    server = _server(FakeEngine(), interval_s=0.05)
    asyncio.run(_serve_until_done(server, kill_after_s=None))
    assert server.engine_failure is None


def test_lingering_connections_do_not_hold_the_exit_past_the_grace() -> None:
    grace_s = 0.2

    async def run() -> tuple[EngineWatchedServer, float]:
        server = _server(DyingEngine(0), interval_s=0.05, drain_s=0.0, grace_s=grace_s)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a request that never completes
        await writer.drain()
        await asyncio.sleep(0.1)
        started = time.monotonic()
        server._engine.dead = True  # type: ignore[attr-defined]
        await asyncio.wait_for(task, timeout=30)
        writer.close()
        return server, time.monotonic() - started

    server, elapsed = asyncio.run(run())
    assert server.engine_failure is not None
    assert elapsed < grace_s + 3.0


def test_the_server_answers_503_through_the_drain_then_exits() -> None:
    """Once the watchdog has noticed the death, new connections are still answered (the app
    says 503) for `drain_s`, so probes see an unhealthy server, not a refused connection."""
    engine = DyingEngine(0)
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.dead else 200)

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = EngineWatchedServer(config, engine, interval_s=0.05, drain_s=1.0, grace_s=5.0)

    async def run() -> tuple[int, float]:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        engine.dead = True
        started = time.monotonic()
        await asyncio.sleep(0.4)  # the watchdog has noticed (every 0.05 s); the drain is on
        async with httpx.AsyncClient() as client:
            status = (await client.get(f"http://127.0.0.1:{port}/health")).status_code
        await asyncio.wait_for(task, timeout=30)
        return status, time.monotonic() - started

    status, elapsed = asyncio.run(run())
    assert status == 503
    assert isinstance(server.engine_failure, EngineDeadError)
    assert 1.0 <= elapsed < 5.0
