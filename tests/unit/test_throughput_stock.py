"""`benchmarks/throughput.py`'s stock engine: vLLM's loaders find no processor of ours there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from script_loading import load_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
LOADERS = """
import json
from vllm.v1.sample.logits_processor import _load_logitsprocs_plugins
from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins
import noisy_temp_server.vllm_plugin.processor  # the package itself stays importable
print(json.dumps([[c.__name__ for c in load()] for load in
                  (_load_logitsprocs_plugins, _load_v2_logitsprocs_plugins)]))
"""


def _benchmark() -> ModuleType:
    return load_script(BENCHMARK, "throughput_benchmark")


def _loaded_processors(env: dict[str, str] | None) -> list[list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", LOADERS], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_stock_environment_hides_our_entry_point_from_both_loaders(tmp_path: Path) -> None:
    benchmark = _benchmark()
    ours = ["NoisyTemperatureLogitsProcessor"]
    assert _loaded_processors(None) == [ours, ours]
    assert _loaded_processors(benchmark.stock_environment(tmp_path)) == [[], []]
