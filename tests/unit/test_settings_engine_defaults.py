"""Engine settings resolved per device: small defaults and vLLM's compilation on the CPU,
vLLM's own on CUDA."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from noisy_temp_server.server.engine import cpu_compiler_found
from noisy_temp_server.settings import (
    EngineSettings,
    Settings,
    add_settings_arguments,
    engine_settings,
    settings_from_args,
)


def test_cpu_keeps_small_defaults_and_compiles_as_vllm() -> None:
    assert engine_settings(Settings(), on_cpu=True) == EngineSettings(
        kv_cache_gib=2, gpu_memory_utilization=None, max_num_seqs=32, enforce_eager=False
    )


def test_cpu_without_a_compiler_serves_eager_unless_told() -> None:
    assert engine_settings(Settings(), on_cpu=True, cpu_compiler=False).enforce_eager is True
    told = Settings(enforce_eager=False)
    assert engine_settings(told, on_cpu=True, cpu_compiler=False).enforce_eager is False
    assert engine_settings(Settings(), on_cpu=False, cpu_compiler=False).enforce_eager is False


def test_the_compiler_is_looked_up_as_inductor_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert cpu_compiler_found() is False
    compiler = tmp_path / "my-c++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", "my-c++")
    assert cpu_compiler_found() is True


def test_cuda_defaults_to_vllms_own_settings() -> None:
    settings = Settings(shadow_device="cpu")
    assert engine_settings(settings, on_cpu=False) == EngineSettings(
        kv_cache_gib=None, gpu_memory_utilization=0.9, max_num_seqs=None, enforce_eager=False
    )


def test_cuda_leaves_room_for_a_shadow_scorer_on_the_gpu() -> None:
    shared = engine_settings(Settings(shadow_device="cuda"), on_cpu=False)
    alone = engine_settings(Settings(shadow_device="cuda", shadow_fraction=0), on_cpu=False)
    assert shared.gpu_memory_utilization == pytest.approx(0.7)
    assert alone.gpu_memory_utilization == pytest.approx(0.9)


def test_explicit_settings_win_on_both_devices() -> None:
    settings = Settings(kv_cache_gib=8, max_num_seqs=64, enforce_eager=True)
    assert engine_settings(settings, on_cpu=False) == EngineSettings(
        kv_cache_gib=8, gpu_memory_utilization=None, max_num_seqs=64, enforce_eager=True
    )
    assert engine_settings(Settings(enforce_eager=True), on_cpu=True).enforce_eager is True


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(["--enforce-eager"], True), (["--enforce-eager", "false"], False), ([], None)],
)
def test_boolean_flags_take_no_value_for_true_as_vllms_switches(
    flags: list[str], expected: bool | None
) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ["enforce_eager", "enable_auto_tool_choice"])
    args = parser.parse_args([*flags, "--enable-auto-tool-choice"])
    settings = settings_from_args(args)
    assert settings.enforce_eager is expected
    assert settings.enable_auto_tool_choice is True
