"""`server.engine`: the engine arguments and environment the server sets (no engine is
started)."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

from noisy_temp_server.checkpoints.perturbation import RuntimeLogitNoiseSpec
from noisy_temp_server.engine_contract.bias_files import bias_directories
from noisy_temp_server.engine_contract.engine_env import engine_config
from noisy_temp_server.engine_contract.keys import (
    BIAS_DIR_ENV,
    RUNTIME_NOISE_SEED_ENV,
    RUNTIME_NOISE_SIGMA_ENV,
    TRACE_ENDPOINT_ENV,
)
from noisy_temp_server.server import engine
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor
from noisy_temp_server.vllm_plugin.runtime_noise import RuntimeLogitNoiseProcessor


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


def test_tensor_parallel_size_reaches_the_engine(tiny_model_dir: Path) -> None:
    args = engine.build_engine_args(Settings(tensor_parallel_size=2), tiny_model_dir, "m")
    assert args.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("tuned_logprobs", "mode"), [(True, "processed_logprobs"), (False, "raw_logprobs")]
)
def test_logprobs_describe_the_tuned_distribution_unless_turned_off(
    tiny_model_dir: Path, tuned_logprobs: bool, mode: str
) -> None:
    settings = Settings(tuned_logprobs=tuned_logprobs)
    assert engine.build_engine_args(settings, tiny_model_dir, "m").logprobs_mode == mode


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
        config = engine_config()
        seen["noise"] = (config.runtime_noise_sigma, config.runtime_noise_seed)
        return "engine"

    monkeypatch.setenv(TRACE_ENDPOINT_ENV, "ipc:///tmp/nts-test-trace.sock")
    monkeypatch.setenv(RUNTIME_NOISE_SIGMA_ENV, "")  # restored after the test
    monkeypatch.setenv(RUNTIME_NOISE_SEED_ENV, "")
    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_start)
    noise = RuntimeLogitNoiseSpec(sigma=0.75, seed=11)
    assert engine.start_engine(Settings(), tiny_model_dir, "m", noise) == "engine"
    assert seen["noise"] == (0.75, 11)
    assert engine.RUNTIME_NOISE_PROCESSOR_CLASS_PATH in seen["processors"]  # type: ignore[operator]


@pytest.fixture
def clean_process_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """What `prepare_environment` sets is restored after the test; prometheus_client looks
    not yet imported (its module object is put back afterwards)."""
    for name in ("VLLM_CPU_KVCACHE_SPACE", TRACE_ENDPOINT_ENV, BIAS_DIR_ENV):
        monkeypatch.setenv(name, "")
    monkeypatch.delenv(BIAS_DIR_ENV)  # unset, and restored after the test
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delitem(sys.modules, "prometheus_client", raising=False)
    return monkeypatch


def test_without_a_given_metrics_directory_a_fresh_one_is_made_and_removed(
    clean_process_environment: pytest.MonkeyPatch,
) -> None:
    environment = engine.prepare_environment(Settings())
    try:
        assert environment.prometheus_dir.is_dir()
        assert list(environment.prometheus_dir.iterdir()) == []
        assert environment.prometheus_dir.is_relative_to(environment.runtime_dir)
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(environment.prometheus_dir)
    finally:
        environment.cleanup()
    assert not environment.prometheus_dir.exists()


def test_a_given_metrics_directory_is_used_created_and_cleared_of_stale_metric_files(
    clean_process_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    given = tmp_path / "multiproc"
    given.mkdir()
    for name in ("counter_101.db", "histogram_101.db", "gauge_livesum_7.db", "README"):
        (given / name).write_text("old")
    clean_process_environment.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    environment = engine.prepare_environment(Settings())
    environment.cleanup()
    assert environment.prometheus_dir == given
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(given)
    assert [p.name for p in given.iterdir()] == ["README"]  # kept, as is the directory


def test_a_given_metrics_directory_that_does_not_exist_is_created(
    clean_process_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    given = tmp_path / "volume" / "multiproc"
    clean_process_environment.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    environment = engine.prepare_environment(Settings())
    environment.cleanup()
    assert environment.prometheus_dir == given
    assert given.is_dir()


_BIASED = dataclasses.replace(TemperaturePolicy.identity(), bias="ab" * 32)
_ONLINE = "<online>"  # stands for the environment's online_bias_dir


@pytest.mark.parametrize(
    ("settings", "profile_dir", "policy", "expected"),
    [
        ({"profile": "/profiles/int4.json"}, "/profiles", _BIASED, ["/profiles", _ONLINE]),
        ({}, "/package/data", _BIASED, ["/package/data", _ONLINE]),  # the shipped profile
        ({"bias_dir": "/biases"}, "/p", _BIASED, ["/biases", "/p", _ONLINE]),
        ({"bias_dir": "/p"}, "/p", _BIASED, ["/p", _ONLINE]),  # listed once
        ({"profile": "/profiles/int4.json"}, "/profiles", TemperaturePolicy.identity(), []),
        ({"bias_dir": "/biases"}, None, TemperaturePolicy.identity(), ["/biases"]),
        ({}, None, None, []),
    ],
)
def test_the_engine_gets_bias_directories_only_when_a_policy_can_name_a_bias(
    clean_process_environment: pytest.MonkeyPatch,
    settings: dict[str, str],
    profile_dir: str | None,
    policy: TemperaturePolicy | None,
    expected: list[str],
) -> None:
    """The folder given, then the one the profile was loaded from (given, or the shipped
    default-pair profile's) and the writable folder of the online biases, when the startup
    policy names a bias; none for a profile without a bias, so that the V1 processor stays
    argmax-invariant (a variable left from before is removed)."""
    given = Settings(**settings)  # type: ignore[arg-type]
    environment = engine.prepare_environment(given)
    environment.cleanup()
    clean_process_environment.setenv(BIAS_DIR_ENV, "/stale")
    folders = engine.publish_bias_directories(
        given, environment, policy, profile_dir=None if profile_dir is None else Path(profile_dir)
    )
    wanted = tuple(environment.online_bias_dir if f == _ONLINE else Path(f) for f in expected)
    assert folders == wanted
    assert bias_directories() == wanted
    listed = os.pathsep.join(str(folder) for folder in wanted) if wanted else None
    assert os.environ.get(BIAS_DIR_ENV) == listed


def test_an_invalid_inherited_engine_variable_is_refused_before_anything_is_made(
    clean_process_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_process_environment.setenv(RUNTIME_NOISE_SIGMA_ENV, "loud")
    clean_process_environment.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match=RUNTIME_NOISE_SIGMA_ENV):
        engine.prepare_environment(Settings())
    assert list(tmp_path.iterdir()) == []
