"""End to end: `serve --profile` with a profile that names a compensation adapter, on the tiny
model. Float weights (tiny_serve's weight-noise pair) get it folded in: greedy output is the
folded checkpoint's, token for token, and differs from the served model's without it. A
compressed-tensors checkpoint (quantized kernels) gets it through vLLM's LoRA: every request
has it unless it turns it off (`nts_adapter: false`, or the base model id)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from adapter_helpers import adapter_profile, random_adapter
from server_helpers import stop
from tiny_serve import MODEL, TinyServer, start_tiny_server

from noisy_temp_server.adapter.lora import adapter_sha256, fold_adapter
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec
from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint

pytestmark = pytest.mark.vllm

PROMPT = [351, 266, 274, 267, 274, 288]  # "the cat sat on": no near tie in 8 greedy steps
NEW_TOKENS = 8
SERVED_SPEC = WeightNoiseSpec(scale=0.3)  # tiny_serve's pair


def _greedy_with_transformers(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _complete(server: TinyServer, **keys: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "ignore_eos": True, **keys},
        headers=server.headers,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _text(server: TinyServer, **keys: Any) -> str:
    return str(_complete(server, **keys)["choices"][0]["text"])


def _get(server: TinyServer, path: str) -> Any:
    reply = httpx.get(f"{server.url}{path}", headers=server.headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json() if path != "/metrics" else reply.text


def test_a_folded_adapter_serves_the_folded_checkpoints_greedy_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    served_dir = ensure_perturbed_checkpoint(tiny_model_dir, SERVED_SPEC, tmp_path)
    adapter = random_adapter(served_dir, scale=0.5, base_model=tiny_model_dir.name)
    clean = ModelIdentity.of_checkpoint(tiny_model_dir)
    profile = adapter_profile(
        tiny_model_dir,
        ModelIdentity.perturbed(clean, SERVED_SPEC),
        adapter,
        tmp_path / "profile",
    )
    model, tokenizer = load_causal_lm(served_dir)
    without = tokenizer.decode(_greedy_with_transformers(model, PROMPT, NEW_TOKENS))
    fold_adapter(dict(model.named_parameters()), adapter)
    folded = tokenizer.decode(_greedy_with_transformers(model, PROMPT, NEW_TOKENS))
    assert folded != without  # strong enough to be seen
    server = start_tiny_server(  # float32, as transformers computes it
        tiny_model_dir, tmp_path, "--profile", str(profile), "--dtype", "float32"
    )
    try:
        sha = adapter_sha256(adapter)
        status = _get(server, "/v1/nts/status")["adapter"]
        assert (status["path"], status["sha256"], status["rank"]) == ("folded", sha, 4)
        assert f'nts_adapter_info{{path="folded",sha256="{sha[:16]}"}} 1.0' in _get(
            server, "/metrics"
        )
        assert _text(server) == folded
        reply = _complete(server)
        assert reply["nts"]["adapter"] == sha
        refused = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "a", "nts_adapter": False},
            headers=server.headers,
        )
        assert refused.status_code == 400
        assert "folded" in refused.json()["error"]["message"]
    finally:
        stop(server.process)


def test_a_compressed_checkpoint_serves_the_adapter_through_lora(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from noisy_temp_server.checkpoints.compressed import write_compressed_checkpoint  # noqa: PLC0415

    quantized = tmp_path / "w4a16"  # vLLM's CPU W8A8 kernel drops the weights LoRA needs
    write_compressed_checkpoint(tiny_model_dir, "w4a16", quantized, group_size=32)
    adapter = random_adapter(quantized, scale=0.5, base_model=tiny_model_dir.name)
    profile = adapter_profile(
        tiny_model_dir, ModelIdentity.of_checkpoint(quantized), adapter, tmp_path / "profile"
    )
    server = start_tiny_server(
        tiny_model_dir, tmp_path, "--served-model", str(quantized), "--profile", str(profile)
    )
    try:
        sha = adapter_sha256(adapter)
        status = _get(server, "/v1/nts/status")["adapter"]
        assert (status["path"], status["sha256"]) == ("lora", sha)
        models = [card["id"] for card in _get(server, "/v1/models")["data"]]
        assert models == [MODEL, f"{MODEL}-base"]
        with_adapter = _text(server)
        without = _text(server, nts_adapter=False)
        assert with_adapter != without
        assert _text(server, model=f"{MODEL}-base") == without
        assert _text(server) == with_adapter
        assert _complete(server)["nts"]["adapter"] == sha
        assert _complete(server, nts_adapter=False)["nts"]["adapter"] is None
    finally:
        stop(server.process)
