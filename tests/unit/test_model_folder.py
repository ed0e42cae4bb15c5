"""Plain model folders: their identity by content hash (cached in our cache, nothing written
into them, read-only folders fine), sharded weights, Hugging Face ids resolved offline in a
cache laid out here, the pair checked up front, and one-line errors that never suggest deleting
a folder."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from safetensors.torch import load_file, save_file

from noisy_temp_server.checkpoints import model_folder
from noisy_temp_server.checkpoints.checkpoint import (
    MANIFEST_FILENAME,
    CorruptCheckpointError,
    load_causal_lm,
    read_manifest,
)
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.loading import load_pair
from noisy_temp_server.checkpoints.model_folder import (
    ModelFolderError,
    check_pair_folders,
    content_sha256,
    display_name,
    resolve_model_folder,
)


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time."""
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
    }


@pytest.fixture
def plain(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Path]:
    """A copy of the tiny model without our manifest, made read-only."""
    folder = shutil.copytree(tiny_model_dir, tmp_path / "plain")
    (folder / MANIFEST_FILENAME).unlink()
    for path in [*folder.iterdir(), folder]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield folder
    for path in [folder, *folder.iterdir()]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _sharded(tiny_model_dir: Path, dest: Path) -> Path:
    """The tiny model as two safetensors shards with an index, no manifest."""
    folder = shutil.copytree(tiny_model_dir, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / MANIFEST_FILENAME).unlink()
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, members in shards.items():
        save_file(
            {name: tensors[name] for name in members}, folder / shard, metadata={"format": "pt"}
        )
    weight_map = {name: shard for shard, members in shards.items() for name in members}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def test_a_plain_folder_is_identified_by_its_weights_without_writing_into_it(
    plain: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _tree(plain)
    cache = tmp_path / "cache"
    identity = ModelIdentity.of_checkpoint(plain, cache)
    assert identity.name == "plain"
    assert identity.weights_sha256 == read_manifest(tiny_model_dir).weights_sha256
    assert len(list((cache / "identities").iterdir())) == 1
    monkeypatch.setattr(model_folder, "sha256_file", lambda path: pytest.fail("hashed again"))
    assert content_sha256(plain, cache) == identity.weights_sha256  # from the cache
    model, _ = load_causal_lm(plain)
    assert model.config.vocab_size > 0
    assert _tree(plain) == before


def test_a_changed_file_is_hashed_again(plain: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = content_sha256(plain, cache)
    weights = plain / "model.safetensors"
    weights.chmod(0o644)
    os.utime(weights, ns=(1, 1))
    assert content_sha256(plain, cache) == first
    assert len(list((cache / "identities").iterdir())) == 2


def test_an_unwritable_cache_only_costs_the_hashing(plain: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    assert content_sha256(plain, blocker) == content_sha256(plain, tmp_path / "cache")


def test_sharded_weights_load_and_have_an_identity(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _sharded(tiny_model_dir, tmp_path / "sharded")
    identity = ModelIdentity.of_checkpoint(folder, tmp_path / "cache")
    assert identity.weights_sha256 is not None
    assert identity.weights_sha256 != read_manifest(tiny_model_dir).weights_sha256
    pair = load_pair(tiny_model_dir, served_path=folder)
    for clean, served in zip(
        pair.clean_model.parameters(), pair.served_model.parameters(), strict=True
    ):
        assert clean.equal(served)


def _hub_cache(root: Path, model_id: str, source: Path) -> Path:
    """`source` laid out as the Hugging Face cache holds the model `model_id` (main)."""
    repo = root / f"models--{model_id.replace('/', '--')}"
    snapshot = shutil.copytree(source, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_a_hugging_face_id_resolves_offline_in_the_local_cache(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hub"
    snapshot = _hub_cache(hub, "someone/tiny-llama", tiny_model_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))  # read at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    found = resolve_model_folder("someone/tiny-llama")
    assert found.resolve() == snapshot.resolve()
    assert display_name(found) == "someone/tiny-llama"
    with pytest.raises(
        ModelFolderError, match="the local Hugging Face cache holds no model someone/other"
    ):
        resolve_model_folder("someone/other")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (shutil.rmtree, "no model folder"),
        (lambda folder: (folder / "config.json").unlink(), "holds no config.json"),
        (lambda folder: (folder / "config.json").write_text("{"), "config.json is unreadable"),
        (
            lambda folder: (folder / "model.safetensors").rename(folder / "pytorch_model.bin"),
            "pickled weights",
        ),
        (lambda folder: (folder / "model.safetensors").unlink(), "holds no safetensors weights"),
        (
            lambda folder: (folder / "config.json").write_text(
                json.dumps({"vocab_size": 512, "quantization_config": {"quant_method": "hqq"}})
            ),
            "quantized with 'hqq'",
        ),
    ],
)
def test_a_bad_folder_gets_one_line_that_never_suggests_deleting_it(
    tiny_model_dir: Path, tmp_path: Path, damage: object, message: str
) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "bad")
    (folder / MANIFEST_FILENAME).unlink()
    damage(folder)  # type: ignore[operator]
    with pytest.raises(ModelFolderError, match=message) as error:
        load_pair(tiny_model_dir, served_path=folder)
    assert "\n" not in str(error.value)
    assert "rm " not in str(error.value)
    assert "delete" not in str(error.value)


def test_a_damaged_checkpoint_of_ours_is_not_to_be_deleted_either(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "ours")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(CorruptCheckpointError) as error:
        load_causal_lm(folder)
    assert "rm " not in str(error.value)
    assert "delete" not in str(error.value)


def _edit_json(path: Path, **changes: object) -> None:
    document = json.loads(path.read_text())
    document.update(changes)
    path.write_text(json.dumps(document))


def test_the_pair_is_checked_before_any_model_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    (other / MANIFEST_FILENAME).unlink()
    check_pair_folders(tiny_model_dir, other, same_architecture=True)
    _edit_json(other / "config.json", num_hidden_layers=3)
    check_pair_folders(tiny_model_dir, other)  # another architecture: fine for scoring
    with pytest.raises(ModelFolderError, match="num_hidden_layers is 2, the served model's 3"):
        check_pair_folders(tiny_model_dir, other, same_architecture=True)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    first = next(iter(tokenizer["model"]["vocab"]))
    tokenizer["model"]["vocab"]["renamed"] = tokenizer["model"]["vocab"].pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelFolderError, match="the clean and served tokenizers differ"):
        check_pair_folders(tiny_model_dir, other)
    _edit_json(other / "config.json", vocab_size=1024)
    with pytest.raises(
        ModelFolderError, match="vocabulary has 512 tokens, the served model's 1024"
    ):
        load_pair(tiny_model_dir, served_path=other)
