"""The temperature processor inside a stock vLLM OpenAI server (the README's recipe).

The package's `vllm.logits_processors` entry point makes every vLLM engine in this environment
load the processor; requests opt in with `vllm_xargs`, bad `nts_*` values are refused by vLLM's
own validation with HTTP 400, and with `--logprobs-mode processed_logprobs` the returned
logprobs show T*.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import free_port, running_server

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def stock_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("NTS_POLICY_FILE", None)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--logprobs-mode",
        "processed_logprobs",
    ]
    log = tmp_path_factory.mktemp("stock-vllm") / "server.log"
    with running_server(
        "stock vLLM server", command, port=port, log=log, timeout_s=START_TIMEOUT_S, env=env
    ) as url:
        yield url


def _first_token_top2_gap(url: str, xargs: dict[str, Any]) -> float:
    reply = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "the quick brown fox",
            "max_tokens": 1,
            "temperature": 1.0,
            "logprobs": 2,
            "vllm_xargs": xargs,
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    top = sorted(reply.json()["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
    return top[0] - top[1]


def test_fixed_rule_divides_the_logits_by_t(stock_server: str) -> None:
    untuned = _first_token_top2_gap(stock_server, {"nts_tune": False})
    tuned = _first_token_top2_gap(stock_server, {"nts_rule": "fixed", "nts_t": 2.0})
    assert untuned > 0.05
    assert tuned == pytest.approx(untuned / 2, rel=1e-3)


def test_bad_rule_is_a_400_and_the_server_keeps_serving(stock_server: str) -> None:
    reply = httpx.post(
        f"{stock_server}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "vllm_xargs": {"nts_rule": "x"}},
        timeout=60,
    )
    assert reply.status_code == 400
    assert "nts_rule" in reply.json()["error"]["message"]
    assert _first_token_top2_gap(stock_server, {"nts_tune": False}) > 0
