"""End to end: `serve --profile` with a profile that recommends the per-token bias. The bias
file beside the profile reaches the engine (its bias directory), greedy requests are served
with it, `nts.bias` says so, `nts_bias: false` turns it off, /v1/nts/status names it, and the
shadow scorer feeds paired rows of sampled requests to the online bias, which publishes to a
folder of its own. A profile whose bias sits on a head map serves the two together."""

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

from noisy_temp_server.correction.files import (
    bias_sha256,
    head_map_sha256,
    save_bias_file,
    save_head_map_file,
)
from noisy_temp_server.correction.head_map import HeadMap
from noisy_temp_server.pairs.identity import ModelIdentity
from noisy_temp_server.pairs.perturbation import WeightNoiseSpec

pytestmark = pytest.mark.vllm

LIFTED = 7  # the token the bias lifts far above every other
BAND_TEMPERATURES = (1.25, 1.0)


def _bias_profile(
    tiny_model_dir: Path, folder: Path, head_map: HeadMap | None = None
) -> tuple[Path, str]:
    """A profile of tiny_serve's pair recommending a bias that lifts `LIFTED` (a zero bias on
    `head_map` when given), with its files."""
    from transformers import AutoConfig  # noqa: PLC0415

    bias = torch.zeros(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    mapped: dict[str, Any] = {}
    folder.mkdir()
    if head_map is None:
        bias[LIFTED] = 1e3
    else:
        save_head_map_file(folder, head_map)
        mapped = {
            "head_map": head_map_sha256(head_map),
            "head_map_rank": head_map.rank,
            "head_map_penalty": 1.0,
        }
    save_bias_file(folder, bias)
    profile = sample_profile()
    clean = ModelIdentity.of_checkpoint(tiny_model_dir)
    # T at the sample profile's request temperatures 0.7 and 1.0
    summary = sample_bias(
        profile, bias_sha256(bias), bias.numel(), band_temperatures=BAND_TEMPERATURES, **mapped
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


def test_a_bias_on_a_head_map_is_served_with_the_map(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A random rank-1 map strong enough to move the greedy tokens: served with the profile's
    (zero) bias, named in `nts` and on the status; sampled requests are shadow-scored and
    refine the bias on mapped rows."""
    from transformers import AutoConfig  # noqa: PLC0415

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    generator = torch.Generator().manual_seed(0)
    head_map = HeadMap(
        left=30 * torch.randn(vocab, 1, generator=generator),
        right=torch.randn(1, vocab, generator=generator) / vocab**0.5,
    )
    profile, sha = _bias_profile(tiny_model_dir, tmp_path / "profile", head_map)
    server = start_tiny_server(
        tiny_model_dir, tmp_path, "--profile", str(profile), *SCORE_EVERY_REQUEST
    )
    try:
        status = httpx.get(f"{server.url}/v1/nts/status", headers=server.headers).json()
        assert (status["bias"], status["head_map"]) == (sha, head_map_sha256(head_map))
        mapped, plain = _complete(server), _complete(server, nts_bias=False)
        assert (mapped["nts"]["bias"], mapped["nts"]["head_map"]) == (sha, status["head_map"])
        assert plain["nts"]["head_map"] is None
        assert mapped["choices"][0]["text"] != plain["choices"][0]["text"]
        assert _complete(server, temperature=1.0)["nts"]["head_map"] == status["head_map"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/v1/nts/status", headers=server.headers).json()
            if status["estimator"]["bias"]["requests"] == 1:
                break
            time.sleep(1)
        assert status["estimator"]["bias"]["requests"] == 1
    finally:
        stop(server.process)
