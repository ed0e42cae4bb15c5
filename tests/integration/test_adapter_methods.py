"""`experiments/adapter_methods.py` on the tiny model: two fit methods side by side, each on one
and on two completions per fit prompt, and a bad ``--methods`` or ``--completions`` refused in
one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "experiments" / "adapter_methods.py"
SPEC = '{"kind": "weight_noise", "scale": 0.1}'


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(BENCHMARK.parents[1])}
    return subprocess.run(
        [sys.executable, str(BENCHMARK), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )


def test_both_methods_correct_the_test_prompts_and_are_compared(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    done = _run(
        "--clean", str(tiny_model_dir), "--spec", SPEC, "--rank", "4",
        "--methods", "eora:0.01,propagated:10", "--completions", "1,2", "--fit-prompts", "6",
        "--max-new-tokens", "8", "--threads", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    rows = {row["method"]: row for row in result["methods"]}
    assert list(rows) == ["eora:0.01", "eora:0.01 ×2", "propagated:10", "propagated:10 ×2"]
    assert all(row["share_removed"] > 0 for row in rows.values())
    assert rows["eora:0.01"]["versus"] == {}
    assert set(rows["propagated:10 ×2"]["versus"]) == set(list(rows)[:3])
    # the second completions change the fit: more inputs, another adapter
    assert rows["eora:0.01 ×2"]["kl"] != rows["eora:0.01"]["kl"]
    assert result["completions_per_fit_prompt"] == [1, 2]
    assert "| propagated:10 ×2 |" in (tmp_path / "result.md").read_text()


def test_a_bad_method_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _run("--spec", SPEC, "--methods", "lorc:1", "--out", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: --methods entry 'lorc:1': expected eora:R, propagated:R or svd"
    ]


@pytest.mark.parametrize("counts", ["1,0", "1,1", "1,²", "four"])
def test_a_bad_completion_count_is_refused_in_one_line(tmp_path: Path, counts: str) -> None:
    done = _run("--spec", SPEC, "--completions", counts, "--out", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: --completions {counts!r}: expected distinct whole numbers >= 1, e.g. 1,4"
    ]
