"""`benchmarks/quality_adapter.py` on the tiny model: the stack of a pair with weight error and
the refusal where the served weights are the clean ones; `benchmarks/quality.py` refusing
adapter options without an adapter in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from script_loading import load_script

from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.loading import load_pair
from noisy_temp_server.checkpoints.perturbation import RuntimeLogitNoiseSpec, WeightNoiseSpec

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_adapter.py"
QUALITY = BENCHMARK.with_name("quality.py")


@pytest.fixture(scope="module")
def benchmark() -> ModuleType:
    return load_script(BENCHMARK, "quality_adapter")


def _settings(rank: int, **adapter: int) -> CalibrationSettings:
    return CalibrationSettings(
        prompts=24,
        max_new_tokens=20,
        validation_fraction=0.5,
        bias_rows=500,
        adapter_rank=rank,
        **adapter,
    )


def test_the_stack_of_a_pair_with_weight_error(benchmark: ModuleType, tiny_model_dir: Path) -> None:
    pair = load_pair(tiny_model_dir, spec=WeightNoiseSpec(scale=0.1))
    family = benchmark.calibrate_family(
        pair, load_prompts()[:24], _settings(8, adapter_fit_completions=2)
    )
    assert family.refusal is None
    text, document = benchmark.stack_section(pair, family, greedy_tokens=4)
    labels = [layer["label"] for layer in document["test_prompts"]["layers"]]
    assert labels[:2] == ["served, T=1", "adapter, T=1"]
    assert labels[2].startswith("adapter + T (")
    adapter_alone = document["test_prompts"]["layers"][1]
    assert adapter_alone["share_removed"] > 0
    assert "oracle T" in document["test_prompts"]["oracle_share_removed"]
    constant = [
        share
        for name, share in document["test_prompts"]["oracle_share_removed"].items()
        if name.startswith("best constant T = ")
    ]
    assert len(constant) == 1
    assert constant[0] <= document["test_prompts"]["oracle_share_removed"]["oracle T"] + 1e-9
    assert "adapter: rank 8 propagated, ridge " in text
    assert ", refitted on 2 completions per prompt, 14 layers" in text


def test_runtime_noise_is_refused_an_adapter_and_calibrated_without_one(
    benchmark: ModuleType, tiny_model_dir: Path
) -> None:
    pair = load_pair(tiny_model_dir, spec=RuntimeLogitNoiseSpec(sigma=0.5))
    settings = _settings(4, adapter_fit_completions=2, adapter_distil_epochs=1)
    family = benchmark.calibrate_family(pair, load_prompts()[:24], settings)
    assert family.refusal is not None
    assert family.refusal.startswith("--adapter-rank needs a pair whose served weights differ")
    profile = family.data.result.profile
    assert profile.adapter is None
    plain = CalibrationSettings.model_validate(profile.settings.model_dump())  # loads again
    assert (plain.adapter_rank, plain.adapter_fit_completions, plain.adapter_distil_epochs) == (
        0,
        1,
        0,
    )
    text, document = benchmark.stack_section(pair, family, greedy_tokens=4)
    assert text.startswith("adapter: not applicable, calibration refuses it")
    assert document["test_prompts"]["layers"][0]["label"] == "served, T=1"


def test_quality_refuses_adapter_options_without_an_adapter_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(QUALITY), "--adapter-fit-completions", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(QUALITY.parents[1])},
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: invalid calibration settings: ")
    assert "adapter_fit_completions > 1 needs an adapter" in line
    assert not any(tmp_path.iterdir())
