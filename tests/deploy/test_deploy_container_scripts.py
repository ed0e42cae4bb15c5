"""The images' entry point (deploy/docker/entrypoint.sh) and health check
(deploy/docker/healthcheck.py), run here as the container would run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

DOCKER_DIR = Path(__file__).resolve().parents[2] / "deploy" / "docker"
ENTRYPOINT = DOCKER_DIR / "entrypoint.sh"
HEALTHCHECK = DOCKER_DIR / "healthcheck.py"


@pytest.fixture
def fake_server_command(tmp_path: Path) -> Path:
    """A `noisy-temp-server` on PATH that records its arguments and what it found in the
    multiprocess directory when it started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "noisy-temp-server"
    fake.write_text(
        "#!/bin/sh\n"
        'printf "%s\\n" "$@" > "$RECORD_DIR/args"\n'
        'ls -A "$PROMETHEUS_MULTIPROC_DIR" > "$RECORD_DIR/multiproc_listing"\n'
    )
    fake.chmod(0o755)
    return bin_dir


def run_entrypoint(
    bin_dir: Path, record_dir: Path, multiproc_dir: Path | None, *args: str
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_DIR": str(record_dir)}
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    return subprocess.run(
        [str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, check=False, timeout=30
    )


def test_entrypoint_empties_the_multiprocess_directory_and_serves(
    fake_server_command: Path, tmp_path: Path
) -> None:
    multiproc = tmp_path / "multiproc"
    (multiproc / "nested").mkdir(parents=True)
    (multiproc / "histogram_123.db").write_bytes(b"stale")
    (multiproc / ".hidden").write_bytes(b"stale")
    (multiproc / "nested" / "gauge_9.db").write_bytes(b"stale")

    result = run_entrypoint(
        fake_server_command, tmp_path, multiproc, "--port", "9000", "--served-model", "/m x"
    )

    assert result.returncode == 0, result.stderr
    assert (tmp_path / "args").read_text().splitlines() == [
        "serve",
        "--port",
        "9000",
        "--served-model",
        "/m x",
    ]
    assert (tmp_path / "multiproc_listing").read_text() == ""
    assert multiproc.is_dir()


def test_entrypoint_creates_a_missing_multiprocess_directory(
    fake_server_command: Path, tmp_path: Path
) -> None:
    multiproc = tmp_path / "not" / "there"
    result = run_entrypoint(fake_server_command, tmp_path, multiproc)
    assert result.returncode == 0, result.stderr
    assert multiproc.is_dir()


def test_entrypoint_refuses_to_run_without_a_multiprocess_directory(
    fake_server_command: Path, tmp_path: Path
) -> None:
    result = run_entrypoint(fake_server_command, tmp_path, None)
    assert result.returncode != 0
    assert "PROMETHEUS_MULTIPROC_DIR" in result.stderr
    assert not (tmp_path / "args").exists()


class _HealthHandler(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[ThreadingHTTPServer, type[_HealthHandler]]]:
    handler = type("Handler", (_HealthHandler,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


def run_healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env={**os.environ, "NTS_PORT": str(port)},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_healthcheck_passes_when_health_answers_200(
    health_server: tuple[ThreadingHTTPServer, type[_HealthHandler]],
) -> None:
    server, _ = health_server
    result = run_healthcheck(server.server_address[1])
    assert result.returncode == 0, result.stderr


def test_healthcheck_fails_when_health_answers_an_error(
    health_server: tuple[ThreadingHTTPServer, type[_HealthHandler]],
) -> None:
    server, handler = health_server
    handler.status = 503
    result = run_healthcheck(server.server_address[1])
    assert result.returncode == 1
    assert "503" in result.stderr


def test_healthcheck_fails_when_nothing_listens() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HealthHandler)
    port = server.server_address[1]
    server.server_close()
    result = run_healthcheck(port)
    assert result.returncode == 1
    assert "unhealthy" in result.stderr
