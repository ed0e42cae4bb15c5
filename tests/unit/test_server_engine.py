"""`server.engine`: the engine arguments and environment the server sets (no engine is
started)."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

from noisy_temp_server.pairs.perturb import RuntimeLogitNoiseSpec
from noisy_temp_server.server import engine
from noisy_temp_server.settings import Settings
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor
from noisy_temp_server.vllm_plugin.runtime_noise import (
    RUNTIME_NOISE_SEED_ENV,
    RUNTIME_NOISE_SIGMA_ENV,
    RuntimeLogitNoiseProcessor,
    runtime_noise_from_env,
)


def _entry_points_return(found: list[EntryPoint], monkeypatch: pytest.MonkeyPatch) -> None:
    def lookup(*, group: str) -> list[EntryPoint]:
        assert group == "vllm.logits_processors"
        return found

    monkeypatch.setattr(engine, "entry_points", lookup)


def test_processor_not_installed_is_registered_by_a_name_vllm_loads(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _entry_points_return([], monkeypatch)
    args = engine.build_engine_args(Settings(), tiny_model_dir, "m")
    assert args.logits_processors == [engine.PROCESSOR_CLASS_PATH]
    assert _load_logitsprocs_by_fqcns(args.logits_processors) == [NoisyTemperatureLogitsProcessor]


def test_installed_processor_is_left_to_vllm(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = EntryPoint(
        "noisy_temperature", engine.PROCESSOR_CLASS_PATH, "vllm.logits_processors"
    )
    _entry_points_return([installed], monkeypatch)
    args = engine.build_engine_args(Settings(), tiny_model_dir, "m")
    assert args.logits_processors is None


def test_runtime_noise_registers_its_processor_by_name(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _entry_points_return([], monkeypatch)
    noise = RuntimeLogitNoiseSpec(sigma=1.0)
    args = engine.build_engine_args(Settings(), tiny_model_dir, "m", runtime_noise=noise)
    assert _load_logitsprocs_by_fqcns(args.logits_processors) == [
        NoisyTemperatureLogitsProcessor,
        RuntimeLogitNoiseProcessor,
    ]


def test_start_engine_sets_the_runtime_noise_environment_before_the_engine_starts(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}

    def fake_start(args: Any, usage_context: Any) -> str:
        seen["processors"] = args.logits_processors
        seen["noise"] = runtime_noise_from_env()
        return "engine"

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv(RUNTIME_NOISE_SIGMA_ENV, "")  # restored after the test
    monkeypatch.setenv(RUNTIME_NOISE_SEED_ENV, "")
    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_start)
    noise = RuntimeLogitNoiseSpec(sigma=0.75, seed=11)
    assert engine.start_engine(Settings(), tiny_model_dir, "m", noise) == "engine"
    assert seen["noise"] == (0.75, 11)
    assert engine.RUNTIME_NOISE_PROCESSOR_CLASS_PATH in seen["processors"]  # type: ignore[operator]
