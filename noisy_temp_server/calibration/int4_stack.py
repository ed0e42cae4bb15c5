"""The int4 stack (`serve --int4-stack true`): the embedded model quantized to int4
(round-to-nearest, group 128; `INT4_STACK_SPEC`) with a compensation adapter of the default
rank and T* and the per-token bias calibrated on top of it, scored live against the clean
embedded model.

The profile and its adapter are calibrated at first use (minutes on a CPU, logged) into
``cache_dir/stacks/<served name>-r<rank>/`` and reused afterwards; the folder appears whole or
not at all, so an interrupted calibration starts over at the next start.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from noisy_temp_server.adapter.layer_fit import DEFAULT_ADAPTER_RANK
from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.calibration.run import calibrate_to_files
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec
from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint

__all__ = ["INT4_STACK_SPEC", "STACK_PROFILE", "Int4Stack", "ensure_int4_stack"]

_LOGGER = logging.getLogger("noisy_temp_server.serve")

INT4_STACK_SPEC = QuantizationSpec(format="int4", group_size=128)
STACK_PROFILE = "profile.json"


@dataclass(frozen=True)
class Int4Stack:
    """The stack's pair and the profile calibrated for it (its adapter beside it)."""

    served: Path
    clean: Path
    profile: Path


def _ensure_profile(served: Path, clean: Path, cache_dir: Path) -> Path:
    """The stack's profile for `served`, from the cache, or calibrated now and cached (written
    beside its folder, then renamed into place)."""
    folder = cache_dir / "stacks" / f"{served.name}-r{DEFAULT_ADAPTER_RANK}"
    if (folder / STACK_PROFILE).is_file():
        return folder / STACK_PROFILE
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _LOGGER.info("Calibrating the int4 stack once (adapter rank %d) ...", DEFAULT_ADAPTER_RANK)
        prompts = load_prompts(None)
        settings = CalibrationSettings(prompts=len(prompts), adapter_rank=DEFAULT_ADAPTER_RANK)
        calibrate_to_files(
            clean, prompts, settings, staging / STACK_PROFILE, served=served, cache_dir=cache_dir
        )
        try:
            staging.rename(folder)
        except OSError:  # another server cached it meanwhile
            if not (folder / STACK_PROFILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder / STACK_PROFILE


def ensure_int4_stack(cache_dir: Path) -> Int4Stack:
    """The int4 stack's pair and profile under `cache_dir`, made now where missing (the default
    model converted, its int4 checkpoint written, the profile calibrated)."""
    clean = ensure_default_model(cache_dir)
    served = ensure_perturbed_checkpoint(clean, INT4_STACK_SPEC, cache_dir)
    return Int4Stack(served, clean, _ensure_profile(served, clean, cache_dir))
