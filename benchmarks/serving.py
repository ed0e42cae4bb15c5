"""What the HTTP serving benchmarks share: a server subprocess on a free port, and a round of
concurrent completions against it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["ServerProcess", "completions_round", "stop_process"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class ServerProcess:
    """An OpenAI-compatible server subprocess: ``command`` plus ``--port`` (a free one); its
    output goes to ``log_path``."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.gettempdir()) / f"nts-bench-{name}-{self.port}.log"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [*command, "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_healthy(self, timeout: float) -> None:
        """Until ``GET /health`` answers 200; RuntimeError if the server exits or is late."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy in time; see {self.log_path}")
            time.sleep(1.0)

    def stop(self) -> None:
        stop_process(self.process)


async def completions_round(
    url: str, body: dict[str, Any], *, requests: int, streams: int, seed: int
) -> int:
    """Send ``requests`` ``POST /v1/completions`` of ``body`` (request ``i`` with seed
    ``seed + i``) over ``streams`` concurrent clients; the number of generated tokens."""
    pending = list(range(requests))

    async def client(http: httpx.AsyncClient) -> int:
        tokens = 0
        while pending:
            request = pending.pop()
            response = await http.post("/v1/completions", json={**body, "seed": seed + request})
            response.raise_for_status()
            tokens += int(response.json()["usage"]["completion_tokens"])
        return tokens

    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return sum(await asyncio.gather(*(client(http) for _ in range(streams))))
