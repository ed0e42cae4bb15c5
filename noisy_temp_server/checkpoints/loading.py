"""Loading a clean/served pair: the clean model, and the served model made or loaded."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from noisy_temp_server.checkpoints.checkpoint import check_folder, load_causal_lm
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.lean_served import load_lean_served
from noisy_temp_server.checkpoints.model_folder import (
    check_model_folder,
    check_pair_folders,
    resolve_model_folder,
)
from noisy_temp_server.checkpoints.perturbation import (
    PerturbationSpec,
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
    apply_perturbation,
    output_head,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["PACK_ABOVE_SHARE", "LoadedPair", "ServedWeights", "load_pair"]

ServedWeights = Literal["auto", "packed", "float"]
PACK_ABOVE_SHARE = 0.25
"""``auto`` packs a quantized served model whose float copy would take more than this share of
the memory available once the clean model is loaded (docs/adapter.md, "Peak memory")."""


@dataclass(frozen=True)
class LoadedPair:
    """A clean and a served model sharing `tokenizer`, with their identities and the spec;
    `served_path`: the served model's folder (None: made in memory from the clean one)."""

    clean_model: PreTrainedModel
    served_model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    clean: ModelIdentity
    served: ModelIdentity
    perturbation: PerturbationSpec | None
    served_path: Path | None = None

    @property
    def runtime_noise(self) -> RuntimeLogitNoiseSpec | None:
        return self.perturbation if isinstance(self.perturbation, RuntimeLogitNoiseSpec) else None

    def head_basis(self, vocab_size: int) -> torch.Tensor | None:
        """The clean model's output-head weight [V, d] (detached), the basis of the bias's
        head-span part (`correction.bias`), when it has one row per token of `vocab_size`;
        else None (the bias is then fitted per token only)."""
        weight = output_head(self.clean_model)
        return None if weight is None or weight.shape[0] != vocab_size else weight.detach()


def _available_bytes(device: torch.device) -> int:
    """The memory free on `device` now: a CUDA device's, else the machine's ``MemAvailable``
    (Linux), or its free pages where that cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return 1024 * int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _load_served(
    served_path: Path,
    clean_path: Path,
    clean_model: PreTrainedModel,
    device: str | torch.device,
    served_weights: ServedWeights,
) -> PreTrainedModel:
    """The served model, packed (`load_lean_served`: quantized layers dequantized one at a time
    when read, tensors equal to the clean ones shared) or whole in float (`load_causal_lm`), as
    `served_weights` says; ``auto`` packs it when its float copy would take over a quarter of
    the memory left beside the clean model (`PACK_ABOVE_SHARE`). Both compute the same logits;
    a folder `load_lean_served` does not cover is always loaded whole."""
    check_folder(served_path)
    parameter = next(clean_model.parameters())
    float_bytes = sum(p.nbytes for p in clean_model.parameters())
    packed = served_weights == "packed" or (
        served_weights == "auto"
        and float_bytes > PACK_ABOVE_SHARE * _available_bytes(parameter.device)
    )
    if packed:
        lean = load_lean_served(served_path, clean_path, clean_model, parameter.dtype)
        if lean is not None:
            return lean
    model, _ = load_causal_lm(served_path, device=device, verify=False)
    return model


def load_pair(
    clean_path: Path,
    *,
    served_path: Path | None = None,
    spec: PerturbationSpec | None = None,
    device: str | torch.device = "cpu",
    same_architecture: bool = False,
    cache_dir: Path | None = None,
    served_weights: ServedWeights = "auto",
) -> LoadedPair:
    """Load the clean model and make or load the served model.

    Both are model folders or Hugging Face model ids (`resolve_model_folder`), checked as a pair
    before any model is loaded (`check_pair_folders`, with `same_architecture` when an adapter
    is to be fitted: ModelFolderError naming the difference). With `served_path` (a plain folder,
    or a checkpoint of `noisy-temp-server perturb` or `quantize`), a perturbation its manifest
    records is used, and a recorded clean identity must match `clean_path` (ValueError naming
    both otherwise). With `spec` instead, weight perturbations are applied to an in-memory copy
    of the clean model and a runtime-noise spec serves the clean weights; the served identity
    is then `ModelIdentity.perturbed(clean, spec)`, which a profile matches against the
    checkpoint `perturb` writes for the same spec. Plain folders' identities are cached in
    `cache_dir` (default: the product's cache). A quantized served folder is loaded packed or
    whole as `served_weights` says (`_load_served`: packed, it holds no float copy of its own).
    """
    clean_path = resolve_model_folder(clean_path)
    if served_path is not None:
        served_path = resolve_model_folder(served_path)
        check_pair_folders(clean_path, served_path, same_architecture=same_architecture)
    else:
        check_model_folder(clean_path)
    clean = ModelIdentity.of_checkpoint(clean_path, cache_dir)
    clean_model, tokenizer = load_causal_lm(clean_path, device=device)
    if served_path is not None:
        served = ModelIdentity.of_checkpoint(served_path, cache_dir)
        served_model = _load_served(served_path, clean_path, clean_model, device, served_weights)
        recorded_clean = served.clean_weights_sha256
        if recorded_clean is not None and recorded_clean != clean.weights_sha256:
            raise ValueError(
                f"{served_path} was made from weights sha256 {recorded_clean[:12]}..., not from "
                f"{clean_path} ({clean.describe()}); pass the clean checkpoint it was made from"
            )
        spec = served.perturbation or spec
        return LoadedPair(clean_model, served_model, tokenizer, clean, served, spec, served_path)
    if spec is None:
        raise ValueError("give a served checkpoint or a perturbation spec")
    if isinstance(spec, WeightNoiseSpec | QuantizationSpec):
        served_model = copy.deepcopy(clean_model)
        apply_perturbation(served_model, spec)
        served = ModelIdentity.perturbed(clean, spec)
        return LoadedPair(clean_model, served_model, tokenizer, clean, served, spec)
    if isinstance(spec, RuntimeLogitNoiseSpec):
        served = ModelIdentity.perturbed(clean, spec)
        return LoadedPair(clean_model, clean_model, tokenizer, clean, served, spec)
    return load_pair(
        spec.clean_path,
        served_path=spec.served_path,
        device=device,
        same_architecture=same_architecture,
        cache_dir=cache_dir,
        served_weights=served_weights,
    )
