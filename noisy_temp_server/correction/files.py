"""The identity and storage of a per-token bias vector and of a head map: their content hashes,
the safetensors files named by them (written atomically, found in a search path of folders), and
the check that a bias fits a model's vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from noisy_temp_server.correction.head_map import HeadMap
from noisy_temp_server.files import write_atomically

__all__ = [
    "bias_file_name",
    "bias_sha256",
    "check_bias_vocabulary",
    "check_head_map_vocabulary",
    "find_bias_file",
    "find_head_map_file",
    "head_map_file_name",
    "head_map_sha256",
    "load_bias_file",
    "load_head_map_file",
    "save_bias_file",
    "save_head_map_file",
]

_Stored = TypeVar("_Stored")


def _float32_bytes(tensor: Tensor) -> bytes:
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()


def bias_sha256(bias: Tensor) -> str:
    """Content hash of a bias vector: sha256 of its float32 little-endian bytes."""
    return hashlib.sha256(_float32_bytes(bias)).hexdigest()


def head_map_sha256(head_map: HeadMap) -> str:
    """Content hash of a head map: sha256 of its rank, then the float32 little-endian bytes of
    `left` and of `right` (the rank tells where one ends)."""
    digest = hashlib.sha256(f"head-map rank {head_map.rank}\n".encode())
    digest.update(_float32_bytes(head_map.left))
    digest.update(_float32_bytes(head_map.right))
    return digest.hexdigest()


def check_bias_vocabulary(bias: Tensor, vocab_size: int | None, where: str) -> None:
    """ValueError unless `bias` has one entry per token of the vocabulary of `where` (named in
    the message), `vocab_size` tokens (None: unknown, which no bias fits): a bias fitted for
    another model."""
    if bias.numel() != vocab_size:
        raise ValueError(
            f"the per-token bias {bias_sha256(bias)[:16]}... has {bias.numel()} entries but "
            f"{where} has a vocabulary of {vocab_size} tokens; it was fitted for another model"
        )


def check_head_map_vocabulary(head_map: HeadMap, vocab_size: int | None, where: str) -> None:
    """ValueError unless `head_map` maps rows of the vocabulary of `where`, `vocab_size` tokens
    (as `check_bias_vocabulary`)."""
    if head_map.vocab_size != vocab_size:
        raise ValueError(
            f"the head map {head_map_sha256(head_map)[:16]}... maps rows of "
            f"{head_map.vocab_size} tokens but {where} has a vocabulary of {vocab_size} tokens; "
            "it was fitted for another model"
        )


def bias_file_name(sha256: str) -> str:
    """The file a bias vector is stored in, named by its content hash."""
    return f"bias-{sha256[:16]}.safetensors"


def head_map_file_name(sha256: str) -> str:
    """The file a head map is stored in, named by its content hash."""
    return f"head-map-{sha256[:16]}.safetensors"


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


def _find(
    folders: Sequence[Path],
    kind: str,
    file_name: str,
    load: Callable[[Path], _Stored],
) -> _Stored:
    """`load(folder)` of the first of `folders` that has `file_name` (a search path: the name
    is the content hash, so any folder's copy is the same); ValueError naming the `kind` of
    file and the folders when none has it."""
    for folder in folders:
        if (Path(folder) / file_name).is_file():
            return load(Path(folder))
    searched = ", ".join(str(folder) for folder in folders) or "no folder"
    raise ValueError(f"no {kind} file {file_name} in {searched}")


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
    """`load_bias_file` from the first of `folders` that has the file of `sha256`; ValueError
    naming the folders when none has it."""
    return _find(
        folders, "bias", bias_file_name(sha256), lambda folder: load_bias_file(folder, sha256)
    )


def save_head_map_file(folder: Path, head_map: HeadMap) -> Path:
    """Write `head_map` (its `left` and `right`, float32) to
    `folder / head_map_file_name(sha256)`; returns the path. As `save_bias_file`."""
    path = Path(folder) / head_map_file_name(head_map_sha256(head_map))
    return _write(path, {"left": head_map.left, "right": head_map.right})


def load_head_map_file(folder: Path, sha256: str) -> HeadMap:
    """The head map with content hash `sha256` that `save_head_map_file` wrote to `folder`
    (float32, finite, `left` [V, r] and `right` [r, V]); ValueError when the file is missing or
    unreadable, or does not hold that map."""
    path = Path(folder) / head_map_file_name(sha256)
    tensors = _read(path, ["left", "right"])
    left, right = tensors["left"], tensors["right"]
    if left.dim() != 2 or left.shape[::-1] != right.shape:
        raise ValueError(f"head map file {path} does not hold a [V, r] and an [r, V] matrix")
    head_map = HeadMap(left=left, right=right)
    if head_map_sha256(head_map) != sha256:
        raise ValueError(f"head map file {path} does not hold the map {sha256[:16]}...")
    return head_map


def find_head_map_file(folders: Sequence[Path], sha256: str) -> HeadMap:
    """`load_head_map_file` from the first of `folders` that has the file of `sha256`;
    ValueError naming the folders when none has it."""
    return _find(
        folders,
        "head map",
        head_map_file_name(sha256),
        lambda folder: load_head_map_file(folder, sha256),
    )
