"""A compensation adapter in a stock vLLM OpenAI server beside the temperature processor (the
README's recipe): ``--enable-lora --lora-modules nts=<adapter folder>``. The adapter model
(``nts``) generates what the checkpoint with the adapter folded in generates (transformers,
float32), the base model (``tiny``) what the checkpoint alone does, and the processor tunes
requests to the adapter model as it does any other."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from adapter_helpers import random_adapter
from server_helpers import free_port, running_server

from noisy_temp_server.adapter.lora import fold_adapter, save_peft_adapter
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 600
PROMPT = [351, 266, 274, 267, 274, 288]  # "the cat sat on": no near tie in 8 greedy steps
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    adapter = random_adapter(tiny_model_dir, scale=0.5, base_model=tiny_model_dir.name)
    return save_peft_adapter(tmp_path_factory.mktemp("adapters"), adapter)


@pytest.fixture(scope="module")
def stock_server(
    tiny_model_dir: Path, adapter_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("NTS_POLICY_FILE", None)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model_dir),
        "--served-model-name", "tiny",
        "--enable-lora",
        "--lora-modules", f"nts={adapter_folder}",
        "--max-lora-rank", "8",
        "--port", str(port),
        "--host", "127.0.0.1",
        "--max-model-len", "256",
        "--dtype", "float32",
        "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("stock-vllm-lora") / "server.log"
    with running_server(
        "stock vLLM server with LoRA",
        command,
        port=port,
        log=log,
        timeout_s=START_TIMEOUT_S,
        env=env,
    ) as url:
        yield url


def _complete(url: str, model: str, **body: Any) -> dict[str, Any]:
    request = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json={**request, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["choices"][0])


def _greedy_tokens(model: Any) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def _served_tokens(url: str, model: str) -> list[int]:
    choice = _complete(url, model, ignore_eos=True, return_token_ids=True)
    return [int(token) for token in choice["token_ids"]]


def test_the_adapter_model_generates_the_folded_checkpoints_tokens(
    stock_server: str, tiny_model_dir: Path, adapter_folder: Path
) -> None:
    from noisy_temp_server.adapter.lora import load_peft_adapter  # noqa: PLC0415

    model, _ = load_causal_lm(tiny_model_dir)
    base = _greedy_tokens(model)
    fold_adapter(dict(model.named_parameters()), load_peft_adapter(adapter_folder))
    folded = _greedy_tokens(model)
    assert folded != base
    assert _served_tokens(stock_server, "nts") == folded
    assert _served_tokens(stock_server, "tiny") == base


def test_the_processor_tunes_requests_to_the_adapter_model(stock_server: str) -> None:
    def gap(xargs: dict[str, Any]) -> float:
        choice = _complete(
            stock_server, "nts", max_tokens=1, temperature=1.0, logprobs=2, vllm_xargs=xargs
        )
        top = sorted(choice["logprobs"]["top_logprobs"][0].values(), reverse=True)
        return float(top[0] - top[1])

    untuned = gap({"nts_tune": False})
    assert untuned > 0.05
    assert gap({"nts_rule": "fixed", "nts_t": 2.0}) == pytest.approx(untuned / 2, rel=1e-3)
