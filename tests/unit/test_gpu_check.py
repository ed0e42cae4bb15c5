"""`benchmarks/gpu_check.py` on the CPU at small sizes, so the prepared GPU check never rots: it
runs without vLLM, writes its JSON, and the CPU step equals itself on every case, and so does the
fused step in Triton's interpreter (rows whole and split into chunks); its comparisons do catch a
wrong logit, a NaN in the wrong place and a wrong delivered summary."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

_RUN_WITHOUT_VLLM = """
import runpy, sys
sys.modules["vllm"] = None  # importing vllm (or any vllm.*) raises ImportError
sys.path.insert(0, {benchmarks!r})
sys.argv = ["gpu_check.py", *{argv!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def _run(out: Path, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """gpu_check.py with ``argv`` (and ``--out``) in a fresh interpreter without vLLM."""
    code = _RUN_WITHOUT_VLLM.format(
        benchmarks=str(BENCHMARKS),
        argv=[*argv, "--out", str(out)],
        script=str(BENCHMARKS / "gpu_check.py"),
    )
    env = {**os.environ, **env, "PYTHONPATH": ""}  # the script finds the checkout's package
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu_check") / "results.json"
    return _run(out, ["--device", "cpu", "--quick", "--threads", "1"], {})


def test_the_fused_step_passes_in_the_interpreter(tmp_path: Path) -> None:
    argv = [
        "--device",
        "cpu",
        "--quick",
        "--threads",
        "1",
        "--fused-step",
        "on",
        "--correctness-only",
    ]
    argv += ["--batches", "1", "5", "--vocabs", "5000", "--programs", "10"]  # two chunks a row
    results = _run(tmp_path / "results.json", argv, {"TRITON_INTERPRET": "1"})
    assert results["meta"]["fused_kernel_used"]
    assert results["meta"]["programs"] == 10
    cases = results["correctness"]["cases"]
    assert len(cases) == 8 * 2 * 2
    assert all(case["passed"] for case in cases), [c for c in cases if not c["passed"]]
    assert results["cost"] == []
    assert not results["cost_complete"]


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:  # the module itself, for its comparisons
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_quick_cpu_run_covers_every_case_and_passes(
    results: dict[str, Any], gpu_check: ModuleType
) -> None:
    policies, corrections = gpu_check.POLICIES, gpu_check.CORRECTIONS
    meta = results["meta"]
    assert meta["device"] == "cpu"
    assert meta["tolerance"] == {"rtol": 1e-4, "atol": 1e-4}
    cases = results["correctness"]["cases"]
    sizes = {(b, v) for b in meta["batches"] for v in meta["vocabs"]}
    expected = {(r, c, b, v) for r in policies for c in corrections for b, v in sizes}
    assert {(c["rule"], c["correction"], c["batch"], c["vocab"]) for c in cases} == expected
    assert results["correctness"]["passed"]
    assert results["correctness"]["skipped"] == 0
    assert all(case["passed"] and case["sync_error"] is None for case in cases)
    assert all(set(case["delivered"]) >= {"summaries", "traces", "captured_rows"} for case in cases)
    assert results["cost_complete"]
    assert len(results["cost"]) == len(expected)
    for row in results["cost"]:
        assert row["step_device_us"] > 0
        assert row["quiet_step_device_us"] > 0
        assert row["quiet_step_pipelined_us"] > 0
        assert row["divide_device_us"] > 0
        assert row["limit_us"] > 0
    assert results["copy_bandwidth_gb_s"] > 0
    goals = {goal["name"]: goal for goal in results["goals"]}
    assert set(goals) == {
        "no_synchronising_call",
        "host_us_per_step",
        "step_over_divide",
        "reading_step_over_divide",
    }
    warm_up = results["warm_up"]
    assert warm_up["construction_s"] > 0
    assert warm_up["first_step_host_us"] > 0
    assert warm_up["variants_compiled_by_the_steps"] in (0, None)  # None: Triton is absent
    # Not measurable here: no sync check on a CPU, and the goal size is not in the quick sizes.
    assert all(goal["passed"] is None for goal in goals.values())
    assert results["passed"] is True


def test_quick_cpu_run_measures_the_adapter_and_its_fit_matches(results: dict[str, Any]) -> None:
    decode = results["adapter"]["lora_decode"]
    assert {(row["batch"], row["rank"]) for row in decode["rows"]} == {
        (b, r) for b in (1, 8) for r in (4, 8)
    }
    assert all(row["base_us_per_block"] > 0 and row["lora_over_base"] > 0 for row in decode["rows"])
    assert decode["folding"]["matches"]
    fit = results["adapter"]["fit"]
    assert [row["projection"] for row in fit["projections"]] == [
        "k_proj",
        "v_proj",
        "q_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert fit["skipped"] == []
    assert fit["cpu_comparison"]["matches_cpu"]


def test_adapter_comparisons_catch_a_wrong_delta(gpu_check: ModuleType) -> None:
    adapter = importlib.import_module("gpu_check_parts.adapter")
    layer = adapter._FusedLayer.random((6, 2, 2), 5, 3, torch.float32, torch.device("cpu"))
    x = torch.randn(4, 5)
    unmerged = torch.empty(4, 10)
    layer.forward(x, unmerged)
    assert torch.allclose(unmerged, x @ layer.folded().T, atol=1e-5)
    layer.ups[1][0, 0] += 1.0  # the middle slice's up factor no longer matches the fold below
    folded = x @ layer.folded().T
    layer.ups[1][0, 0] -= 1.0
    layer.forward(x, unmerged)
    assert not torch.allclose(unmerged, folded, atol=1e-5)


def test_logits_comparison_catches_errors(gpu_check: ModuleType) -> None:
    want = torch.tensor([[1.0, -torch.inf, 3.0], [torch.nan, 0.5, 2.0]])
    assert gpu_check._logits_error(want.clone(), want) == (True, 0.0)
    shifted = want.clone()
    shifted[0, 2] += 1e-2
    close, error = gpu_check._logits_error(shifted, want)
    assert not close
    assert error == pytest.approx(1e-2, rel=1e-3)
    unmasked = want.clone()
    unmasked[0, 1] = -50.0
    assert not gpu_check._logits_error(unmasked, want)[0]
    no_nan = want.clone()
    no_nan[1, 0] = 0.0
    assert not gpu_check._logits_error(no_nan, want)[0]


def test_delivered_comparison_catches_a_wrong_summary(gpu_check: ModuleType) -> None:
    delivered = {
        "state": np.array([[2.6, 2.0, 1.3, 1.3]]),
        "summaries": [("request-0", 1, 2.6, 2, 1.3, 1.3)],
        "traces": [("request-0", 0, 1.3)],
        "rows": [([("request-0", 0)], np.ones((1, 3), dtype=np.float32))],
        "bad_rows": 0,
        "histogram": {"count": 2.0, "sum": 2.6},
    }
    assert all(gpu_check._compare_delivered(delivered, delivered).values())
    wrong = {**delivered, "summaries": [("request-0", 1, 2.7, 2, 1.3, 1.4)]}
    verdict = gpu_check._compare_delivered(wrong, delivered)
    assert not verdict["summaries"]
    assert verdict["traces"]
