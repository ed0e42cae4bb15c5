"""Checkpoint folders: atomic writes, manifests, corruption detection, loading."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from noisy_temp_server.checkpoints.checkpoint import (
    MANIFEST_FILENAME,
    WEIGHTS_FILENAME,
    CheckpointManifest,
    CorruptCheckpointError,
    load_causal_lm,
    read_manifest,
    save_checkpoint,
    sha256_file,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir: Path) -> tuple[object, object]:
    return load_causal_lm(tiny_model_dir)


def _save(dest: Path, tiny_pair: tuple[object, object], **kwargs: object) -> CheckpointManifest:
    model, tokenizer = tiny_pair
    options: dict[str, object] = {"kind": "test", "description": "a test", "source": "unit test"}
    options.update(kwargs)
    return save_checkpoint(dest, model, tokenizer, **options)  # type: ignore[arg-type]


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_manifest_records_every_file_with_its_hash(tiny_model_dir: Path) -> None:
    manifest = read_manifest(tiny_model_dir)
    on_disk = {p.name for p in tiny_model_dir.iterdir()} - {MANIFEST_FILENAME}
    assert set(manifest.files) == on_disk
    assert {"config.json", "generation_config.json", "tokenizer.json", WEIGHTS_FILENAME} <= on_disk
    for name, record in manifest.files.items():
        assert record.size == (tiny_model_dir / name).stat().st_size
        assert record.sha256 == sha256_file(tiny_model_dir / name)
    assert manifest.weights_sha256 == manifest.files[WEIGHTS_FILENAME].sha256
    assert manifest.kind == "tiny-model"


def test_save_keeps_metadata_and_leaves_no_temporaries(
    tmp_path: Path, tiny_pair: tuple[object, object]
) -> None:
    spec = {"perturbation": "weight_noise", "sigma": 0.01, "layers": [0, 1]}
    written = _save(tmp_path / "ckpt", tiny_pair, metadata=spec)
    assert read_manifest(tmp_path / "ckpt") == written
    assert dict(written.metadata) == spec
    assert verify_checkpoint(tmp_path / "ckpt") == written
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_rejects_unserialisable_metadata_before_writing(
    tmp_path: Path, tiny_pair: tuple[object, object]
) -> None:
    with pytest.raises(TypeError):
        _save(tmp_path / "ckpt", tiny_pair, metadata={"tensor": torch.zeros(1)})
    assert not any(tmp_path.iterdir())


def test_save_refuses_to_overwrite_unless_asked(
    tmp_path: Path, tiny_pair: tuple[object, object]
) -> None:
    dest = tmp_path / "ckpt"
    _save(dest, tiny_pair, metadata={"version": 1})
    with pytest.raises(FileExistsError, match="replace=True"):
        _save(dest, tiny_pair, metadata={"version": 2})
    assert read_manifest(dest).metadata == {"version": 1}
    _save(dest, tiny_pair, metadata={"version": 2}, replace=True)
    assert read_manifest(dest).metadata == {"version": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_failed_save_leaves_no_destination(
    tmp_path: Path, tiny_pair: tuple[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = tiny_pair

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path / "ckpt", tiny_pair)
    assert not any(tmp_path.iterdir())


def test_losing_a_race_raises_and_keeps_the_winner(
    tmp_path: Path, tiny_pair: tuple[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "ckpt"
    model, _ = tiny_pair
    original_save = type(model).save_pretrained

    def save_while_a_rival_wins(self: object, folder: Path, **kwargs: object) -> None:
        original_save(self, folder, **kwargs)
        monkeypatch.setattr(type(model), "save_pretrained", original_save)
        _save(dest, tiny_pair, metadata={"writer": "rival"})

    monkeypatch.setattr(type(model), "save_pretrained", save_while_a_rival_wins)
    with pytest.raises(FileExistsError, match="another process"):
        _save(dest, tiny_pair, metadata={"writer": "loser"})
    assert verify_checkpoint(dest).metadata == {"writer": "rival"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_verify_detects_a_missing_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = _copy(tiny_model_dir, tmp_path / "ckpt")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"tokenizer\.json is missing"):
        verify_checkpoint(folder, full=False)


def test_verify_detects_a_truncated_file_without_hashing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    folder = _copy(tiny_model_dir, tmp_path / "ckpt")
    weights = folder / WEIGHTS_FILENAME
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors has \d+ bytes"):
        verify_checkpoint(folder, full=False)


def test_only_the_full_check_detects_a_flipped_byte(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = _copy(tiny_model_dir, tmp_path / "ckpt")
    weights = folder / WEIGHTS_FILENAME
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    verify_checkpoint(folder, full=False)
    with pytest.raises(CorruptCheckpointError, match="sha256") as error:
        verify_checkpoint(folder, full=True)
    assert str(folder) in str(error.value)
    assert "To fix it" in str(error.value)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "noisy_temp_server.json is missing"),
        ("{not json", "unreadable"),
        (json.dumps({"format": "something-else"}), "unreadable"),
    ],
)
def test_verify_detects_a_bad_manifest(
    tmp_path: Path, tiny_model_dir: Path, content: str | None, problem: str
) -> None:
    folder = _copy(tiny_model_dir, tmp_path / "ckpt")
    if content is None:
        (folder / MANIFEST_FILENAME).unlink()
    else:
        (folder / MANIFEST_FILENAME).write_text(content)
    with pytest.raises(CorruptCheckpointError, match=problem):
        verify_checkpoint(folder)


def test_verify_puts_the_given_remedy_in_the_message(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"does not exist.*run `make-it`"):
        verify_checkpoint(tmp_path / "absent", remedy="run `make-it`")


def test_load_refuses_a_corrupt_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = _copy(tiny_model_dir, tmp_path / "ckpt")
    (folder / "config.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"config\.json"):
        load_causal_lm(folder)


def test_load_gives_an_eval_model_in_the_asked_dtype(tiny_model_dir: Path) -> None:
    model, tokenizer = load_causal_lm(tiny_model_dir, dtype=torch.bfloat16)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert tokenizer.eos_token == "<|im_end|>"
