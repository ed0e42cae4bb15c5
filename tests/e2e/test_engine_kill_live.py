"""End to end: kill vLLM's engine core process under load. Requests in flight get a 503 (or,
once their stream has started, an in-band error) saying the engine failed, never a 500;
`/health` answers 503; and `serve` exits with status 1 within a bounded time, for a supervisor
to restart it."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_helpers import log_tail
from tiny_serve import MODEL, TinyServer, start_tiny_server

pytestmark = pytest.mark.vllm

CONCURRENT = 6
EXIT_WITHIN_S = 60.0


def _engine_core(server: TinyServer) -> psutil.Process:
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
            return child
    pytest.fail(f"no EngineCore process below the server\n{log_tail(server.log)}")


def _request(server: TinyServer, stream: bool, started: threading.Event) -> dict[str, Any]:
    """One long request; its status and, for streams, its events."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions",
            json={**body, "stream": stream}, headers=server.headers,
        ) as response,
    ):  # fmt: skip
        if not stream or response.status_code != 200:
            started.set()
            return {"status": response.status_code, "body": json.loads(response.read())}
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                started.set()
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return {"status": 200, "events": events}


def _load(server: TinyServer) -> tuple[list[threading.Thread], list[dict[str, Any]], Any]:
    results: list[dict[str, Any]] = []
    streaming = threading.Event()

    def run(stream: bool) -> None:
        try:
            results.append(_request(server, stream, streaming))
        except httpx.HTTPError as error:  # a connection cut by the exit
            results.append({"status": None, "error": repr(error)})

    threads = [
        threading.Thread(target=run, args=(i % 2 == 0,), daemon=True) for i in range(CONCURRENT)
    ]
    for thread in threads:
        thread.start()
    return threads, results, streaming


def _engine_failed(result: dict[str, Any]) -> bool:
    if result["status"] == 503:
        return bool(result["body"]["error"]["code"] == "engine_dead")
    events = result.get("events") or []
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    return bool(errors) and errors[-1]["error"]["code"] == "engine_dead"


def test_killing_the_engine_core_fails_requests_with_503_and_exits_1(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_tiny_server(tiny_model_dir, tmp_path, "--shadow-fraction", "0")
    try:
        core = _engine_core(server)
        threads, results, streaming = _load(server)
        assert streaming.wait(120), log_tail(server.log)
        core.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        health = []
        while server.process.poll() is None and time.monotonic() - killed_at < EXIT_WITHIN_S:
            with contextlib.suppress(httpx.HTTPError):
                health.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
            time.sleep(0.1)
        exit_code = server.process.wait(
            timeout=max(1.0, EXIT_WITHIN_S - (time.monotonic() - killed_at))
        )
        for thread in threads:
            thread.join(30)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    log = log_tail(server.log, 80)
    assert exit_code == 1, log
    assert 503 in health, (health, log)
    assert 200 not in health[health.index(503) :], health
    assert len(results) == CONCURRENT
    assert all(r["status"] != 500 for r in results), results
    assert any(_engine_failed(r) for r in results), results
    assert all(_engine_failed(r) or r["status"] == 200 for r in results), results
    assert "the engine failed" in log
