"""End to end: `serve --profile` with a profile that recommends the per-token bias. The bias
file beside the profile reaches the engine (its bias directory), greedy requests are served
with it, `nts.bias` says so, `nts_bias: false` turns it off, /v1/nts/status names it, and the
shadow scorer feeds paired rows of sampled requests to the online bias, which publishes to a
folder of its own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from profile_helpers import sample_bias, sample_profile
from server_helpers import stop
from tiny_serve import MODEL, SCORE_EVERY_REQUEST, TinyServer, start_tiny_server

from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec
from noisy_temp_server.correction.files import bias_sha256, save_bias_file

pytestmark = pytest.mark.vllm

LIFTED = 7  # the token the bias lifts far above every other
BAND_TEMPERATURES = (1.25, 1.0)


def _bias_profile(tiny_model_dir: Path, folder: Path) -> tuple[Path, str]:
    """A profile of tiny_serve's pair recommending a bias that lifts `LIFTED`, with its file."""
    from transformers import AutoConfig  # noqa: PLC0415

    bias = torch.zeros(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    bias[LIFTED] = 1e3
    folder.mkdir()
    save_bias_file(folder, bias)
    profile = sample_profile()
    clean = ModelIdentity.of_checkpoint(tiny_model_dir)
    # T at the sample profile's request temperatures 0.7 and 1.0
    summary = sample_bias(
        profile, bias_sha256(bias), bias.numel(), band_temperatures=BAND_TEMPERATURES
    )
    served = ModelIdentity.perturbed(clean, WeightNoiseSpec(scale=0.3))  # tiny_serve's pair
    path = folder / "pair.profile.json"
    profile.model_copy(update={"clean": clean, "served": served, "bias": summary}).save(path)
    return path, summary.sha256


def _complete(server: TinyServer, **keys: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "the cat sat on", "max_tokens": 5, "temperature": 0}
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "logprobs": 1, "ignore_eos": True, **keys},
        headers=server.headers,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_a_recommended_bias_is_served_to_greedy_requests(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    profile, sha = _bias_profile(tiny_model_dir, tmp_path / "profile")
    server = start_tiny_server(
        tiny_model_dir, tmp_path, "--profile", str(profile), *SCORE_EVERY_REQUEST
    )
    try:
        status = httpx.get(f"{server.url}/v1/nts/status", headers=server.headers).json()
        assert status["bias"] == sha
        biased, plain = _complete(server), _complete(server, nts_bias=False)
        assert biased["nts"]["bias"] == sha
        assert plain["nts"]["bias"] is None
        top = [max(step.values()) for step in biased["choices"][0]["logprobs"]["top_logprobs"]]
        assert len(top) == 5
        assert min(top) > -1e-3  # the lifted token, at probability ~1
        assert biased["choices"][0]["text"] != plain["choices"][0]["text"]
        # sampled: T* is the bias's band's; shadow-scored, its rows refine the bias
        assert _complete(server, temperature=1.0)["nts"]["t_mean"] == BAND_TEMPERATURES[1]
        assert _complete(server, temperature=0.7)["nts"]["t_mean"] == BAND_TEMPERATURES[0]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/v1/nts/status", headers=server.headers).json()
            if status["estimator"]["bias"]["requests"] == 2:
                break
            time.sleep(1)
        assert status["estimator"]["bias"]["requests"] == 2
        online = Path(status["estimator"]["bias"]["folder"])  # writable, not the profile's
        assert online.name == "biases"
        assert not online.is_relative_to(profile.parent)
    finally:
        stop(server.process)
