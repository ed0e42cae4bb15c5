"""Fixtures shared by the whole test suite.

The session is offline: `pytest_configure` sets `HF_HUB_OFFLINE=1` and `TRANSFORMERS_OFFLINE=1`
before any test module is imported (huggingface_hub reads them at import time, which is why the
fixtures below import the project's model code lazily), and gives vLLM a 1 GiB CPU KV cache
unless `VLLM_CPU_KVCACHE_SPACE` is already set.

Models:
- `tiny_model_dir`: the tiny random Llama (`tiny_model`), built once per session in a
  temporary folder (a second or two).
- `default_model_dir`: the converted SmolLM2-135M-Instruct in the user's cache
  (`NTS_CACHE_DIR`, else ~/.cache/noisy-temp-server), converted once (~40 s) and reused by later
  sessions. Tests that use it are marked `default_model`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def pytest_configure(config: pytest.Config) -> None:
    os.environ.update(_OFFLINE_ENV)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama checkpoint (seed 0), read-only for tests."""
    from tiny_model import build_tiny_llama  # noqa: PLC0415

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model checkpoint in the user's cache, read-only for tests."""
    from noisy_temp_server.checkpoints.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.settings import Settings  # noqa: PLC0415

    return ensure_default_model(Settings().cache_dir)


@pytest.fixture(autouse=True)
def _forget_issued_request_keys() -> Iterator[None]:
    """The API process's memo of the `nts_*` keys it issued (`request_args.issue_extra_args`)
    starts each test empty: keys a test issued and no engine parsed do not reach the next."""
    from noisy_temp_server.engine_contract import request_args  # noqa: PLC0415

    yield
    request_args._ISSUED.clear()
