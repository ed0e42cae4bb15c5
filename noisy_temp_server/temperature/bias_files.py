"""A bias vector's identity and storage: its content hash, the safetensors file named by it
(written atomically, found in a search path of folders), and the check that it fits a model's
vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from noisy_temp_server.files import write_atomically

__all__ = [
    "bias_file_name",
    "bias_sha256",
    "check_bias_vocabulary",
    "find_bias_file",
    "load_bias_file",
    "save_bias_file",
]


def bias_sha256(bias: Tensor) -> str:
    """Content hash of a bias vector: sha256 of its float32 little-endian bytes."""
    data = bias.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return hashlib.sha256(data).hexdigest()


def check_bias_vocabulary(bias: Tensor, vocab_size: int | None, where: str) -> None:
    """ValueError unless `bias` has one entry per token of the vocabulary of `where` (named in
    the message), `vocab_size` tokens (None: unknown, which no bias fits): a bias fitted for
    another model."""
    if bias.numel() != vocab_size:
        raise ValueError(
            f"the per-token bias {bias_sha256(bias)[:16]}... has {bias.numel()} entries but "
            f"{where} has a vocabulary of {vocab_size} tokens; it was fitted for another model"
        )


def bias_file_name(sha256: str) -> str:
    """The file a bias vector is stored in, named by its content hash."""
    return f"bias-{sha256[:16]}.safetensors"


def save_bias_file(folder: Path, bias: Tensor) -> Path:
    """Write `bias` (float32 [V]) to `folder / bias_file_name(sha256)`; returns the path.
    `folder` must exist (a late write after its owner removed it must fail, not create it
    again); any failure to write (no folder, a read-only or full disk) is an OSError. Written
    atomically, readable by any user the umask allows (`write_atomically`)."""
    path = Path(folder) / bias_file_name(bias_sha256(bias))
    write_atomically(path, save({"bias": bias.detach().to("cpu", torch.float32).contiguous()}))
    return path


def load_bias_file(folder: Path, sha256: str) -> Tensor:
    """The bias vector with content hash `sha256` that `save_bias_file` wrote to `folder`
    (float32 [V], finite); ValueError when the file is missing or unreadable, or does not hold
    that vector (it was changed)."""
    path = Path(folder) / bias_file_name(sha256)
    try:
        bias = load_file(str(path))["bias"]
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"cannot read bias file {path}: {error}") from error
    if bias.dim() != 1 or bias.dtype != torch.float32 or not bool(bias.isfinite().all()):
        raise ValueError(f"bias file {path} does not hold a finite float32 vector")
    if bias_sha256(bias) != sha256:
        raise ValueError(f"bias file {path} does not hold the bias with sha256 {sha256[:16]}...")
    return bias


def find_bias_file(folders: Sequence[Path], sha256: str) -> Tensor:
    """`load_bias_file` from the first of `folders` that has the file of `sha256` (a search
    path: the name is the content hash, so any folder's copy is the same vector); ValueError
    naming the folders when none has it."""
    for folder in folders:
        if (Path(folder) / bias_file_name(sha256)).is_file():
            return load_bias_file(folder, sha256)
    searched = ", ".join(str(folder) for folder in folders) or "no folder"
    raise ValueError(f"no bias file {bias_file_name(sha256)} in {searched}")
