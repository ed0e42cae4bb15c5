"""`benchmarks/adapter_methods.py` on the tiny model: two fit methods side by side, and a bad
``--methods`` refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "adapter_methods.py"
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
        "--methods", "eora:0.01,propagated:10", "--fit-prompts", "6",
        "--max-new-tokens", "8", "--threads", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    eora, propagated = result["methods"]
    assert [eora["method"], propagated["method"]] == ["eora:0.01", "propagated:10"]
    assert eora["share_removed"] > 0
    assert propagated["share_removed"] > 0
    assert eora["versus"] == {}
    assert set(propagated["versus"]) == {"eora:0.01"}
    assert "| propagated:10 |" in (tmp_path / "result.md").read_text()


def test_a_bad_method_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _run("--spec", SPEC, "--methods", "lorc:1", "--out", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: --methods entry 'lorc:1': expected eora:R, propagated:R or svd"
    ]
