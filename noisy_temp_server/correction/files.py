"""The identity and storage of a per-token bias vector: its content hash, the safetensors file
named by it (written atomically, found in a search path of folders), and
the check that a bias fits a model's vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
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


def _float32_bytes(tensor: Tensor) -> bytes:
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()


def bias_sha256(bias: Tensor) -> str:
    """Content hash of a bias vector: sha256 of its float32 little-endian bytes."""
    return hashlib.sha256(_float32_bytes(bias)).hexdigest()


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


def _write(path: Path, tensors: dict[str, Tensor]) -> Path:
    """Write float32 copies of `tensors` to `path` (atomically, `write_atomically`; the folder
    must exist: a late write after its owner removed it fails instead of creating it again)."""
    from safetensors.torch import save  # noqa: PLC0415 (the per-step core imports this module)

    contiguous = {
        name: tensor.detach().to("cpu", torch.float32).contiguous()
        for name, tensor in tensors.items()
    }
    write_atomically(path, save(contiguous))
    return path


def _read(path: Path, names: Sequence[str]) -> dict[str, Tensor]:
    """The tensors `names` of the file `path`, each float32 and finite; ValueError otherwise."""
    from safetensors.torch import load_file  # noqa: PLC0415 (as in `_write`)

    try:
        stored = load_file(str(path))
        tensors = {name: stored[name] for name in names}
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or not bool(tensor.isfinite().all()):
            raise ValueError(f"{path} does not hold a finite float32 {name!r}")
    return tensors


def save_bias_file(folder: Path, bias: Tensor) -> Path:
    """Write `bias` (float32 [V]) to `folder / bias_file_name(sha256)`; returns the path.
    `folder` must exist; any failure to write (no folder, a read-only or full disk) is an
    OSError. Written atomically, readable by any user the umask allows (`write_atomically`)."""
    return _write(Path(folder) / bias_file_name(bias_sha256(bias)), {"bias": bias})


def load_bias_file(folder: Path, sha256: str) -> Tensor:
    """The bias vector with content hash `sha256` that `save_bias_file` wrote to `folder`
    (float32 [V], finite); ValueError when the file is missing or unreadable, or does not hold
    that vector (it was changed)."""
    path = Path(folder) / bias_file_name(sha256)
    bias = _read(path, ["bias"])["bias"]
    if bias.dim() != 1:
        raise ValueError(f"bias file {path} does not hold a vector")
    if bias_sha256(bias) != sha256:
        raise ValueError(f"bias file {path} does not hold the bias with sha256 {sha256[:16]}...")
    return bias


def find_bias_file(folders: Sequence[Path], sha256: str) -> Tensor:
    """`load_bias_file` from the first of `folders` that has the file of `sha256` (a search
    path: the name is the content hash, so any folder's copy is the same); ValueError naming the
    folders when none has it."""
    for folder in folders:
        if (Path(folder) / bias_file_name(sha256)).is_file():
            return load_bias_file(Path(folder), sha256)
    searched = ", ".join(str(folder) for folder in folders) or "no folder"
    raise ValueError(f"no bias file {bias_file_name(sha256)} in {searched}")
