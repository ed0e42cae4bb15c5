"""The per-step core (`noisy_temp_server.step`) imports no vLLM: every one of its modules loads in
a fresh interpreter where vLLM cannot be imported, and brings in no third-party package beyond
torch, numpy and prometheus-client, and Triton for the fused kernel alone (the GPU check's
machine has no more)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import noisy_temp_server.step

_BLOCKED = ("vllm", "safetensors", "zmq", "pydantic", "pydantic_settings", "transformers")
_ALLOWED = {"torch", "numpy", "prometheus_client", "noisy_temp_server"}

_PROBE = """
import importlib, json, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, Blocker())
import numpy, torch  # what torch itself loads is torch's business
before = set(sys.modules)
for name in MODULES:
    importlib.import_module(name)
loaded = {name.split(".")[0] for name in set(sys.modules) - before}
third_party = (n for n in loaded if n not in sys.stdlib_module_names)
print(json.dumps(sorted(n for n in third_party if not n.startswith("_sysconfigdata"))))
"""
_FUSED = ("noisy_temp_server.step.fused_step", "noisy_temp_server.step.fused_kernels")


def _step_modules() -> list[str]:
    package = noisy_temp_server.step
    return [package.__name__] + [
        f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
    ]


def _third_party_loaded(modules: list[str]) -> set[str]:
    probe = f"BLOCKED = {_BLOCKED!r}\nMODULES = {modules!r}\n{_PROBE}"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_step_module_imports_without_vllm() -> None:
    modules = _step_modules()
    assert {"slot_tuning", "slot_tables", "logit_bias", "capture", "batch_rows"} <= {
        name.rsplit(".", 1)[-1] for name in modules
    }
    others = _third_party_loaded([name for name in modules if name not in _FUSED])
    assert others <= _ALLOWED, others - _ALLOWED
    every = _third_party_loaded(modules)
    assert every <= _ALLOWED | {"triton"}, every - _ALLOWED
