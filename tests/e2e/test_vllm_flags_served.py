"""End to end: `serve` takes vLLM's engine flags and the model's sampling defaults as `vllm
serve` does. Started with ``--override-generation-config '{"temperature": 0.0}'`` (a vLLM engine
flag), a request that names no temperature is greedy: it answers what an explicit
``temperature: 0`` answers, every time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import stop
from tiny_serve import MODEL, TinyServer, start_tiny_server

pytestmark = pytest.mark.vllm

GREEDY_BY_DEFAULT = ("--override-generation-config", '{"temperature": 0.0}', "--seed", "3")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    started = start_tiny_server(
        tiny_model_dir, tmp_path_factory.mktemp("vllm-flags"), *GREEDY_BY_DEFAULT
    )
    try:
        yield started
    finally:
        stop(started.process)


def _answer(server: TinyServer, **fields: Any) -> str:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, **fields}
    response = httpx.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_an_unset_temperature_takes_the_overridden_generation_config(server: TinyServer) -> None:
    greedy = _answer(server, temperature=0)
    assert _answer(server) == greedy
    assert _answer(server) == greedy
    assert _answer(server, temperature=1.0, seed=1) != greedy  # a set temperature still wins


def test_the_engine_flag_was_taken_not_refused(server: TinyServer) -> None:
    assert "Using default sampling params from the model: {'temperature': 0.0}" in (
        server.log.read_text()
    )
