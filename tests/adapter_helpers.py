"""Compensation adapters for the serving tests: a random one for a checkpoint's linear layers,
and a profile of a pair that names it (written beside it, as `calibrate` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from profile_helpers import sample_adapter, sample_profile

from noisy_temp_server.adapter.folded_checkpoint import linear_shapes
from noisy_temp_server.adapter.lora import LoraAdapter, LowRankDelta, save_peft_adapter
from noisy_temp_server.checkpoints.identity import ModelIdentity

__all__ = ["ADAPTER_MODULES", "adapter_profile", "random_adapter"]

ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(
    checkpoint: Path, *, rank: int = 4, scale: float = 0.5, seed: int = 0, base_model: str = ""
) -> LoraAdapter:
    """A random adapter of `rank` on every projection of the model in `checkpoint`; `scale`:
    the standard deviation of up @ down's entries (0.5 changes the tiny model's greedy
    output)."""
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name, (out_features, in_features) in sorted(linear_shapes(checkpoint).items()):
        if name.rsplit(".", 1)[-1] not in ADAPTER_MODULES:
            continue
        down = torch.randn(rank, in_features, generator=generator) / rank**0.5
        up = torch.randn(out_features, rank, generator=generator) * scale
        layers[name] = LowRankDelta(down=down, up=up)
    return LoraAdapter(layers=layers, rank=rank, base_model=base_model)


def adapter_profile(
    clean: Path, served: ModelIdentity, adapter: LoraAdapter, folder: Path, **summary: Any
) -> Path:
    """Save `adapter` into `folder` and a profile of the pair (`clean`, `served`) naming it
    (`summary` overrides the adapter summary's fields); return the profile's path."""
    profile = sample_profile().model_copy(
        update={"clean": ModelIdentity.of_checkpoint(clean), "served": served}
    )
    save_peft_adapter(folder, adapter)
    profile = profile.model_copy(update={"adapter": sample_adapter(profile, adapter, **summary)})
    path = folder / "profile.json"
    profile.save(path)
    return path
