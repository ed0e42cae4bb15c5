"""A compensation adapter: a low-rank correction of a served model's linear layers, W -> W + B A,
its content hash, its files in PEFT's LoRA format (safetensors only), and its folding into weights.

The adapter is the weight-space correction of a clean/served pair: for each perturbed linear layer
it holds `down` (PEFT's ``lora_A``, [rank, in_features]) and `up` (``lora_B``, [out_features,
rank]) with the scale already folded into `up`, so the served layer computes (W + up @ down) x.
Layers are named by their module path in the Hugging Face model (``model.layers.0.self_attn.
q_proj``). vLLM serves the same files as a LoRA adapter; where the served weights are floats the
adapter is folded into them instead (`fold_adapter`), which computes the same function.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterError",
    "LoraAdapter",
    "LowRankDelta",
    "adapter_folder_name",
    "adapter_sha256",
    "check_adapter_fits",
    "find_adapter",
    "fold_adapter",
    "load_peft_adapter",
    "save_peft_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_LORA_A = ".lora_A.weight"
_LORA_B = ".lora_B.weight"
_UNSUPPORTED_CONFIG = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")


class AdapterError(ValueError):
    """An adapter that cannot be read, or that does not fit the model it is meant for."""


@dataclass(frozen=True)
class LowRankDelta:
    """One layer's correction up @ down: `down` [rank, in_features], `up` [out_features, rank]."""

    down: Tensor
    up: Tensor

    def __post_init__(self) -> None:
        if self.down.ndim != 2 or self.up.ndim != 2 or self.up.shape[1] != self.down.shape[0]:
            raise AdapterError(
                f"a low-rank delta needs down [r, in] and up [out, r]; got down "
                f"{tuple(self.down.shape)} and up {tuple(self.up.shape)}"
            )

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """The (out_features, in_features) of the weight it corrects."""
        return int(self.up.shape[0]), int(self.down.shape[1])

    def dense(self) -> Tensor:
        """up @ down in float32, [out_features, in_features]."""
        return self.up.float() @ self.down.float()


@dataclass(frozen=True)
class LoraAdapter:
    """A compensation adapter: one `LowRankDelta` per corrected layer, all of one `rank`.

    `layers` maps module paths (``model.layers.0.mlp.down_proj``) to their deltas; `base_model`
    names the model it was fitted for (its identity as the profile records it). Refuses (with
    `AdapterError`) no layers, or a layer whose rank differs from `rank`.
    """

    layers: Mapping[str, LowRankDelta]
    rank: int
    base_model: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise AdapterError("an adapter needs at least one layer")
        wrong = sorted(name for name, delta in self.layers.items() if delta.rank != self.rank)
        if wrong:
            raise AdapterError(f"layers {wrong[:3]} do not have the adapter's rank {self.rank}")

    @property
    def target_modules(self) -> list[str]:
        """The short names of the corrected modules (``q_proj``, ``down_proj``), sorted."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.layers})

    @property
    def parameter_count(self) -> int:
        return sum(delta.down.numel() + delta.up.numel() for delta in self.layers.values())


def _float32_bytes(tensor: Tensor) -> bytes:
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()


def adapter_sha256(adapter: LoraAdapter) -> str:
    """Content hash of an adapter: sha256 of its rank, then of each layer in name order, its
    name and the float32 little-endian bytes of `down` and `up`. The base model's name is not
    part of it: the same numbers are the same adapter."""
    digest = hashlib.sha256(f"lora rank {adapter.rank}\n".encode())
    for name in sorted(adapter.layers):
        delta = adapter.layers[name]
        digest.update(f"{name} {delta.shape}\n".encode())
        digest.update(_float32_bytes(delta.down))
        digest.update(_float32_bytes(delta.up))
    return digest.hexdigest()


def adapter_folder_name(sha256: str) -> str:
    """The folder an adapter is stored in, named by its content hash."""
    return f"adapter-{sha256[:16]}"


def _peft_config(adapter: LoraAdapter) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": adapter.base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "target_modules": adapter.target_modules,
        "modules_to_save": None,
    }


def save_peft_adapter(parent: Path, adapter: LoraAdapter) -> Path:
    """Write `adapter` in PEFT's LoRA format into ``parent/adapter-<hash>/`` and return that
    folder: ``adapter_config.json`` (alpha = r, so PEFT's and vLLM's scale is 1) and
    ``adapter_model.safetensors``. The folder appears whole or not at all (written beside it,
    then renamed); an existing folder of the same name holds the same numbers and is kept."""
    parent.mkdir(parents=True, exist_ok=True)
    target = parent / adapter_folder_name(adapter_sha256(adapter))
    if (target / ADAPTER_WEIGHTS).is_file() and (target / ADAPTER_CONFIG).is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".adapter-", dir=parent))
    try:
        tensors: dict[str, Tensor] = {}
        for name, delta in adapter.layers.items():
            tensors[_PEFT_PREFIX + name + _LORA_A] = delta.down.detach().cpu().contiguous()
            tensors[_PEFT_PREFIX + name + _LORA_B] = delta.up.detach().cpu().contiguous()
        save_file(tensors, str(staging / ADAPTER_WEIGHTS))
        (staging / ADAPTER_CONFIG).write_text(json.dumps(_peft_config(adapter), indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _read_config(folder: Path) -> dict[str, object]:
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise AdapterError(f"{folder} is not an adapter: it has no {ADAPTER_CONFIG}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path} is not a LoRA adapter's configuration")
    if config.get("use_dora") or config.get("use_rslora") or config.get("fan_in_fan_out"):
        raise AdapterError(f"{config_path}: DoRA, rsLoRA and fan_in_fan_out are not supported")
    extras = [key for key in _UNSUPPORTED_CONFIG if config.get(key)]
    if config.get("bias", "none") != "none":
        extras.append("bias")
    if extras:
        raise AdapterError(
            f"{config_path}: {', '.join(extras)} are not supported (plain LoRA only)"
        )
    return config


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = folder / "adapter_model.bin"
        why = " (adapter_model.bin is a pickle file, never loaded)" if pickled.exists() else ""
        raise AdapterError(f"{folder} has no {ADAPTER_WEIGHTS}{why}")
    try:
        return load_file(str(weights))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{weights} cannot be read: {exc}") from exc


def load_peft_adapter(folder: Path) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder (ours or any other with plain LoRA weights in
    safetensors). Returns the adapter with PEFT's scale lora_alpha / r folded into `up`.
    Raises `AdapterError` on a missing or unreadable folder, a pickle-only adapter, a
    configuration that is not plain LoRA, or weights whose names or shapes do not pair up."""
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: r must be a positive integer")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: lora_alpha must be a number")
    others = sorted(key for key in tensors if not key.endswith((_LORA_A, _LORA_B)))
    if others:
        raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: weights other than LoRA's: {others[:3]}")
    names = {key[: -len(_LORA_A)] for key in tensors if key.endswith(_LORA_A)}
    if not names or names != {key[: -len(_LORA_B)] for key in tensors if key.endswith(_LORA_B)}:
        raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: lora_A and lora_B weights do not pair up")
    layers = {
        name.removeprefix(_PEFT_PREFIX): LowRankDelta(
            down=tensors[name + _LORA_A], up=tensors[name + _LORA_B] * (float(alpha) / rank)
        )
        for name in sorted(names)
    }
    base_model = str(config.get("base_model_name_or_path") or "")
    return LoraAdapter(layers=layers, rank=rank, base_model=base_model)


def find_adapter(folders: Sequence[Path], sha256: str) -> tuple[Path, LoraAdapter]:
    """The adapter named by `sha256` in the first of `folders` that holds it, with its folder.
    Raises `AdapterError` if none does, or if the folder's numbers do not hash to `sha256`."""
    name = adapter_folder_name(sha256)
    for parent in folders:
        folder = parent / name
        if folder.is_dir():
            adapter = load_peft_adapter(folder)
            if adapter_sha256(adapter) != sha256:
                raise AdapterError(f"{folder} does not hold the adapter {sha256[:16]}...")
            return folder, adapter
    where = ", ".join(str(parent) for parent in folders) or "no folder"
    raise AdapterError(f"adapter {sha256[:16]}... not found in {where}")


def check_adapter_fits(adapter: LoraAdapter, shapes: Mapping[str, tuple[int, int]]) -> None:
    """Raise `AdapterError` unless every layer of `adapter` names a module of `shapes` (module
    path -> (out_features, in_features) of its weight) with the delta's shape."""
    missing = sorted(name for name in adapter.layers if name not in shapes)
    if missing:
        raise AdapterError(f"the adapter corrects modules the model does not have: {missing[:3]}")
    wrong = [
        f"{name} {delta.shape} vs {shapes[name]}"
        for name, delta in sorted(adapter.layers.items())
        if delta.shape != tuple(shapes[name])
    ]
    if wrong:
        raise AdapterError(f"the adapter's shapes do not fit the model: {wrong[:3]}")


def fold_adapter(weights: Mapping[str, Tensor], adapter: LoraAdapter) -> None:
    """Add each layer's up @ down to ``weights[<module>.weight]`` in place (the tensor itself is
    written, so a model's ``state_dict()`` or ``named_parameters()`` folds the model), computed
    in float32 and stored in the weight's dtype. Raises `AdapterError` (before changing
    anything) if a module is missing or misshapen."""
    shapes = {
        key.removesuffix(".weight"): (int(value.shape[0]), int(value.shape[1]))
        for key, value in weights.items()
        if key.endswith(".weight") and value.ndim == 2
    }
    check_adapter_fits(adapter, shapes)
    for name, delta in adapter.layers.items():
        weight = weights[name + ".weight"]
        with torch.no_grad():
            weight.copy_(weight.float() + delta.dense().to(weight.device))
