"""The temperature processor inside a real vLLM engine (CPU, tiny model).

The processor is an installed entry point (``vllm.logits_processors``), so every engine loads
it. The engine here also gets it in ``logits_processors`` (as a user of a stock vLLM might do):
the second instance must stay inert, which the exact-scale test below would catch.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noisy_temp_server.engine_contract.keys import TRACE_ENDPOINT_ENV
from noisy_temp_server.server.trace_collector import TraceCollector

pytestmark = pytest.mark.vllm

PROMPTS = ["the cat sat on", "def add(a, b):", "one two three"]
TOP = 5


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TraceCollector]:
    endpoint = f"ipc://{tmp_path_factory.mktemp('trace')}/trace.sock"
    with TraceCollector(endpoint) as running:
        yield running


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, collector: TraceCollector) -> Iterator[Any]:
    from vllm import LLM  # noqa: PLC0415

    from noisy_temp_server.vllm_plugin.processor import (  # noqa: PLC0415
        NoisyTemperatureLogitsProcessor,
    )

    saved = {k: os.environ.get(k) for k in (TRACE_ENDPOINT_ENV,)}
    os.environ[TRACE_ENDPOINT_ENV] = collector.endpoint
    engine = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        logprobs_mode="processed_logprobs",
        logits_processors=[NoisyTemperatureLogitsProcessor],
        enforce_eager=True,
        seed=0,
    )
    yield engine
    del engine
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _top_logprobs(
    llm: Any, temperature: float, extra_args: dict[str, Any]
) -> list[dict[int, float]]:
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        temperature=temperature, max_tokens=1, logprobs=TOP, seed=0, extra_args=extra_args
    )
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        {tok: lp.logprob for tok, lp in out.outputs[0].logprobs[0].items() if lp.rank <= TOP}
        for out in outputs
    ]


def test_fixed_temperature_scales_the_sampled_distribution(llm: Any) -> None:
    raw = _top_logprobs(llm, 1.0, {"nts_tune": False})
    tuned = _top_logprobs(llm, 0.8, {"nts_rule": "fixed", "nts_t": 2.0})
    effective = 0.8 * 2.0
    for raw_row, tuned_row in zip(raw, tuned, strict=True):
        assert set(raw_row) == set(tuned_row)  # a temperature keeps the order of the top tokens
        top = max(raw_row, key=raw_row.__getitem__)
        for token in raw_row:
            expected = (raw_row[token] - raw_row[top]) / effective
            assert tuned_row[token] - tuned_row[top] == pytest.approx(expected, abs=1e-4)


def test_untuned_request_is_untouched(llm: Any) -> None:
    plain = _top_logprobs(llm, 0.8, {})
    off = _top_logprobs(llm, 0.8, {"nts_rule": "off"})
    assert plain == off
    tuned = _top_logprobs(llm, 0.8, {"nts_rule": "fixed", "nts_t": 2.0})
    assert tuned != plain


def test_schedule_trace_reaches_the_collector(llm: Any, collector: TraceCollector) -> None:
    from vllm import SamplingParams  # noqa: PLC0415

    from noisy_temp_server.temperature.policy import TemperaturePolicy  # noqa: PLC0415
    from noisy_temp_server.temperature.rules import Rule  # noqa: PLC0415

    policy = TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=2.0, schedule_beta=0.5)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=6,
        ignore_eos=True,
        seed=0,
        extra_args={
            "nts_policy": policy.to_json(),
            "nts_trace_id": "schedule-1",
            "nts_trace": True,
        },
    )
    (output,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    steps = len(output.outputs[0].token_ids)
    wait = collector.wait_for("schedule-1", steps, timeout=10.0, want_trace=True)
    report = asyncio.run(wait)
    expected = [2.0 / math.sqrt(1 + 0.5 * t) for t in range(steps)]
    assert list(report.trace) == pytest.approx(expected, rel=1e-6)
    assert report.steps == steps
    assert report.t_mean == pytest.approx(sum(expected) / steps, rel=1e-6)


def test_bad_request_keys_are_rejected_before_the_engine(llm: Any) -> None:
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.exceptions import VLLMValidationError  # noqa: PLC0415

    params = SamplingParams(max_tokens=1, extra_args={"nts_rule": "warm"})
    with pytest.raises(VLLMValidationError, match="not a rule"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
