"""Served logits captured inside a real vLLM engine (CPU, V1 runner, tiny model) against the
same model's float32 logits computed by transformers over the same tokens.

The engine also runs the runtime-noise processor (by class path, as `serve` registers it), so
the order of our two V1 processors is checked: the capture must see the noisy logits that are
sampled from (noise first, then the request temperature, then the capture and T*).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import start_llm, stop_llm

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.engine_contract.keys import (
    RUNTIME_NOISE_SEED_ENV,
    RUNTIME_NOISE_SIGMA_ENV,
    TRACE_ENDPOINT_ENV,
)
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

pytestmark = pytest.mark.vllm

NOISE_CLASS = "noisy_temp_server.vllm_plugin.runtime_noise:RuntimeLogitNoiseProcessor"
STEPS = 12
ATOL = 5e-5
"""Captured row vs transformers, float32 on both sides (logits of magnitude ~10): the engine's
CPU kernels and the V1 multiplication by T_request (<= 2^-23 |z|) differ from transformers' by
at most 1.5e-5 on this model (measured); the bound leaves a factor of 3."""
FIXED = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.7)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    endpoint = f"ipc://{tmp_path_factory.mktemp('capture')}/trace.sock"
    names = (TRACE_ENDPOINT_ENV, RUNTIME_NOISE_SIGMA_ENV, RUNTIME_NOISE_SEED_ENV)
    saved = {name: os.environ.get(name) for name in names}
    with TraceCollector(endpoint) as collector:
        os.environ[TRACE_ENDPOINT_ENV] = collector.endpoint
        os.environ[RUNTIME_NOISE_SIGMA_ENV] = "1.0"
        os.environ[RUNTIME_NOISE_SEED_ENV] = "3"
        llm = start_llm(tiny_model_dir, max_num_seqs=4, logits_processors=[NOISE_CLASS])
        try:
            yield llm, collector
        finally:
            stop_llm(llm)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _generate(llm: Any, temperature: float, **keys: Any) -> tuple[list[int], list[int]]:
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        temperature=temperature, max_tokens=STEPS, ignore_eos=True, seed=1, extra_args=keys
    )
    (output,) = llm.generate(["def add(a, b):"], params, use_tqdm=False)
    return list(output.prompt_token_ids), list(output.outputs[0].token_ids)


def _reference(model_dir: Path, prompt: list[int], completion: list[int]) -> torch.Tensor:
    model, _ = load_causal_lm(model_dir)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)].float()


@pytest.mark.parametrize(
    ("temperature", "tuning"),
    [(1.0, {}), (0.6, {}), (0.8, {"nts_policy": FIXED.to_json()})],
    ids=["T=1", "T=0.6 (multiplied back)", "tuned T*=1.7 (captured before it)"],
)
def test_captured_rows_are_the_models_logits(
    engine: tuple[Any, TraceCollector],
    tiny_model_dir: Path,
    temperature: float,
    tuning: dict[str, Any],
) -> None:
    llm, collector = engine
    trace_id = f"exact-{temperature}-{len(tuning)}"
    keys = {"nts_capture": True, "nts_trace_id": trace_id, "nts_runtime_noise_sigma": 0.0}
    prompt, completion = _generate(llm, temperature, **keys, **tuning)
    rows = collector.take_rows(trace_id, len(completion), timeout=10.0)
    assert rows is not None
    assert rows.steps.tolist() == list(range(len(completion)))
    reference = _reference(tiny_model_dir, prompt, completion)
    torch.testing.assert_close(torch.from_numpy(rows.rows), reference, rtol=0.0, atol=ATOL)


def test_the_capture_sees_the_runtime_noise_it_samples_from(
    engine: tuple[Any, TraceCollector], tiny_model_dir: Path
) -> None:
    llm, collector = engine
    keys = {"nts_capture": True, "nts_trace_id": "noisy", "nts_policy": FIXED.to_json()}
    prompt, completion = _generate(llm, 0.7, **keys)  # the engine's default sigma = 1
    rows = collector.take_rows("noisy", len(completion), timeout=10.0)
    assert rows is not None
    noise = torch.from_numpy(rows.rows) - _reference(tiny_model_dir, prompt, completion)
    assert 0.9 < float(noise.std()) < 1.1  # σ = 1, neither divided by T_request nor by T*
    assert abs(float(noise.mean())) < 0.05


def test_an_unmarked_request_sends_no_rows(engine: tuple[Any, TraceCollector]) -> None:
    llm, collector = engine
    _generate(llm, 1.0, nts_trace_id="plain", nts_policy=FIXED.to_json())
    assert collector.take_rows("plain", STEPS, timeout=1.0) is None
