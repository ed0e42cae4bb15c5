"""Atomic save, verification and loading of a safetensors checkpoint folder.

A checkpoint folder holds what transformers and vLLM both load from a local path:

    config.json, generation_config.json     the model's configuration
    tokenizer.json, tokenizer_config.json   the tokenizer, with its chat template
    chat_template.jinja (when the tokenizer has one)
    model.safetensors                        the weights, one file
    noisy_temp_server.json                   the manifest (`CheckpointManifest`)

The manifest says what the checkpoint is, where it came from, the sha256 and size of every
other file, and free-form `metadata` (e.g. a perturbation spec). It holds no timestamps, so a
deterministic build gives byte-identical folders.

`save_checkpoint` writes into a temporary folder beside the destination and renames it into
place, so a reader sees either no folder or a complete one; a crash leaves only a hidden
`.<name>.tmp-*` folder behind, which a later save of that name removes once it is an hour old
(younger ones may belong to a writer still at work).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from noisy_temp_server import __version__
from noisy_temp_server.checkpoints.model_folder import check_model_folder
from noisy_temp_server.checkpoints.quantized_formats import load_quantized_causal_lm
from noisy_temp_server.files import sha256_file

__all__ = [
    "MANIFEST_FILENAME",
    "WEIGHTS_FILENAME",
    "CheckpointManifest",
    "CorruptCheckpointError",
    "FileRecord",
    "load_causal_lm",
    "read_manifest",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST_FILENAME = "noisy_temp_server.json"
WEIGHTS_FILENAME = "model.safetensors"
MANIFEST_FORMAT = "noisy-temp-server-checkpoint"
MANIFEST_FORMAT_VERSION = 1
_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS_FILENAME)
_STALE_TEMPORARY_SECONDS = 3600.0


class CorruptCheckpointError(RuntimeError):
    """A checkpoint folder is missing, incomplete, or its files do not match its manifest.

    The message names the folder, what is wrong, and what to run to rebuild it.
    """

    def __init__(self, path: Path, problem: str, remedy: str | None = None) -> None:
        self.path = path
        self.problem = problem
        remedy = remedy or (
            "rebuild it with the command that made it (the manifest's `source` says which)"
        )
        super().__init__(f"checkpoint {path} is unusable: {problem}. To fix it, {remedy}.")


@dataclass(frozen=True)
class FileRecord:
    """Size in bytes and sha256 (hex) of one file of a checkpoint."""

    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointManifest:
    """The contents of `noisy_temp_server.json`.

    `kind` is a short machine name (e.g. "default-model", "tiny-model", "perturbed");
    `description` a human sentence; `source` says where the weights came from (a file, a
    command); `files` maps every other file of the folder to its `FileRecord`; `metadata` is
    JSON-serialisable and owned by the writer (e.g. a perturbation spec).
    """

    kind: str
    description: str
    source: str
    files: Mapping[str, FileRecord]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    created_by: str = f"noisy-temp-server {__version__}"

    @property
    def weights_sha256(self) -> str:
        return self.files[WEIGHTS_FILENAME].sha256

    def to_json(self) -> str:
        document = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "kind": self.kind,
            "description": self.description,
            "source": self.source,
            "created_by": self.created_by,
            "files": {
                name: {"size": record.size, "sha256": record.sha256}
                for name, record in sorted(self.files.items())
            },
            "metadata": dict(self.metadata),
        }
        return json.dumps(document, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CheckpointManifest:
        """Parse a manifest; raises ValueError (with the reason) on anything unexpected."""
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
        if document.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"manifest format version {document.get('format_version')!r}, "
                f"this version of noisy-temp-server reads {MANIFEST_FORMAT_VERSION}"
            )
        try:
            files = {
                str(name): FileRecord(size=int(entry["size"]), sha256=str(entry["sha256"]))
                for name, entry in document["files"].items()
            }
            return cls(
                kind=str(document["kind"]),
                description=str(document["description"]),
                source=str(document["source"]),
                files=files,
                metadata=dict(document.get("metadata", {})),
                created_by=str(document.get("created_by", "")),
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed manifest ({error!r})") from error


def _publish_files(folder: Path) -> None:
    """Make every file world-readable (some writers create 0600 files) and flush it to disk."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    directory_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def _remove_stale_temporaries(dest: Path) -> None:
    cutoff = time.time() - _STALE_TEMPORARY_SECONDS
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        with contextlib.suppress(FileNotFoundError):
            if stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(
    dest: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    kind: str,
    description: str,
    source: str,
    metadata: Mapping[str, Any] | None = None,
    replace: bool = False,
) -> CheckpointManifest:
    """Write `model` and `tokenizer` as a checkpoint folder at `dest`, atomically.

    The model is saved with `save_pretrained` (safetensors, one file, tied weights stored once),
    so it must be an ordinary, serialisable transformers model; its dtype is kept. Neither
    argument is modified. `metadata` must be JSON-serialisable (TypeError otherwise, before
    anything is written).

    If `dest` exists: with `replace=False`, FileExistsError; with `replace=True`, the old folder
    is swapped out and deleted after the new one is in place. Two writers racing for the same
    `dest` with `replace=False`: one wins, the other gets FileExistsError and leaves nothing
    behind. Returns the manifest written.
    """
    metadata = dict(metadata or {})
    json.dumps(metadata)
    dest = Path(dest)
    if dest.exists() and not replace:
        raise FileExistsError(f"{dest} exists; pass replace=True to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(dest)
    staging = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    try:
        staging.mkdir()
        model.save_pretrained(staging, max_shard_size="1000GB")
        tokenizer.save_pretrained(staging)
        missing = [name for name in _REQUIRED_FILES if not (staging / name).is_file()]
        if missing:
            raise RuntimeError(
                f"save_pretrained did not write {missing} (got {os.listdir(staging)})"
            )
        files = {
            path.name: FileRecord(size=path.stat().st_size, sha256=sha256_file(path))
            for path in sorted(staging.iterdir())
            if path.is_file()
        }
        manifest = CheckpointManifest(
            kind=kind, description=description, source=source, files=files, metadata=metadata
        )
        (staging / MANIFEST_FILENAME).write_text(manifest.to_json(), encoding="utf-8")
        _publish_files(staging)
        _move_into_place(staging, dest, replace=replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _move_into_place(staging: Path, dest: Path, *, replace: bool) -> None:
    if replace and dest.exists():
        retired = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
        with contextlib.suppress(FileNotFoundError):
            dest.rename(retired)
        try:
            staging.rename(dest)
        finally:
            shutil.rmtree(retired, ignore_errors=True)
        return
    try:
        staging.rename(dest)
    except OSError as error:
        if dest.exists():
            raise FileExistsError(f"{dest} was written by another process meanwhile") from error
        raise


def read_manifest(path: Path) -> CheckpointManifest:
    """The manifest of the checkpoint folder `path`; CorruptCheckpointError if absent or bad."""
    path = Path(path)
    if not path.is_dir():
        raise CorruptCheckpointError(path, "the folder does not exist")
    manifest_path = path / MANIFEST_FILENAME
    try:
        return CheckpointManifest.from_json(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise CorruptCheckpointError(path, f"{MANIFEST_FILENAME} is missing") from error
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(path, f"{MANIFEST_FILENAME} is unreadable: {error}") from error


def verify_checkpoint(
    path: Path, *, full: bool = True, remedy: str | None = None
) -> CheckpointManifest:
    """Check the folder `path` against its manifest and return the manifest.

    Always checks that the manifest parses and every recorded file exists with its recorded
    size; with `full=True` also recomputes every sha256 (about a second per 500 MB). Raises
    CorruptCheckpointError naming the first problem found; `remedy` replaces the generic "what
    to run" part of its message.
    """
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except CorruptCheckpointError as error:
        raise CorruptCheckpointError(path, error.problem, remedy) from error
    missing = [name for name in _REQUIRED_FILES if name not in manifest.files]
    if missing:
        raise CorruptCheckpointError(path, f"the manifest lists no {missing}", remedy)
    for name, record in sorted(manifest.files.items()):
        file_path = path / name
        if not file_path.is_file():
            raise CorruptCheckpointError(path, f"{name} is missing", remedy)
        size = file_path.stat().st_size
        if size != record.size:
            raise CorruptCheckpointError(
                path, f"{name} has {size} bytes, the manifest says {record.size}", remedy
            )
        if full and sha256_file(file_path) != record.sha256:
            raise CorruptCheckpointError(
                path, f"{name} does not match its sha256 in the manifest", remedy
            )
    return manifest


def check_folder(path: Path) -> None:
    """The fast check before loading a model folder: `verify_checkpoint`'s (sizes, no hashing;
    CorruptCheckpointError) for a checkpoint of ours, `check_model_folder`'s (ModelFolderError)
    for a plain folder."""
    if (path / MANIFEST_FILENAME).is_file():
        verify_checkpoint(path, full=False)
    else:
        check_model_folder(path)


def load_causal_lm(
    path: Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    verify: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model folder (a checkpoint of ours, or a plain one) with transformers, from local
    files only.

    Returns `(model, tokenizer)` with the model in eval mode, on `device`, in `dtype`. With
    `verify=True` a checkpoint of ours first gets the fast check of `verify_checkpoint` (sizes,
    no hashing; CorruptCheckpointError if it fails) and a plain folder `check_model_folder`'s
    (ModelFolderError).
    """
    path = Path(path)
    if verify:
        check_folder(path)
    model = load_quantized_causal_lm(path, dtype, device)  # gptq/awq: dequantized on the CPU
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    torch.nn.Module.to(model, torch.device(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
