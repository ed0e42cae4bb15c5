"""`server.engine`: the engine arguments the server builds (no engine is started)."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

from noisy_temp_server.server import engine
from noisy_temp_server.settings import Settings
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor


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


def test_installed_processor_is_left_to_vllm(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = EntryPoint(
        "noisy_temperature", engine.PROCESSOR_CLASS_PATH, "vllm.logits_processors"
    )
    _entry_points_return([installed], monkeypatch)
    args = engine.build_engine_args(Settings(), tiny_model_dir, "m")
    assert args.logits_processors is None
