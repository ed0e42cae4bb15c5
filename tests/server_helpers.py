"""Running a server process in tests: a free loopback port, polling with the log on failure,
and a clean stop. Shared by the tests that start `noisy-temp-server serve` or a stock vLLM
server in a subprocess."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

__all__ = ["free_port", "log_tail", "running_server", "start_server", "stop", "wait_until"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    what: str, timeout_s: float, check: Any, process: subprocess.Popen[bytes], log: Path
) -> None:
    """Poll `check()` until it is truthy; fail, with the log's tail, if `process` exits or time
    runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{what}: exited with {process.returncode}\n{log_tail(log)}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    pytest.fail(f"{what}: not within {timeout_s} s\n{log_tail(log)}")


def log_tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def start_server(
    what: str,
    command: list[str],
    *,
    port: int,
    log: Path,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `command`, a server on 127.0.0.1:`port` writing its output to `log`; return the
    process and its URL once `GET /health` answers 200. The process is killed when it does not
    get there (the test fails with the log's tail)."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            what,
            timeout_s,
            lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
            process,
            log,
        )
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, url


@contextmanager
def running_server(what: str, command: list[str], **options: Any) -> Iterator[str]:
    """`start_server` (same arguments) for the length of a ``with`` block: yields the URL, then
    stops the server."""
    process, url = start_server(what, command, **options)
    try:
        yield url
    finally:
        stop(process)
