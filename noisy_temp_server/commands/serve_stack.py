"""`serve --int4-stack true`: the whole correction stack in one flag.

It serves the embedded model quantized to int4 (round-to-nearest, group 128; `_STACK_SPEC_JSON`)
with a rank-64 compensation adapter (`STACK_ADAPTER_RANK`) and T* and the per-token bias
calibrated on top of it, scored live against the clean embedded model. The profile and its
adapter are calibrated at first use (`noisy-temp-server calibrate --served <int4 checkpoint>
--adapter-rank 64`: minutes on a CPU, logged) into ``cache_dir/stacks/<served name>-r64/`` and
reused afterwards; the folder appears whole or not at all, so an interrupted calibration starts
over at the next start. The adapter is then served as any profile's (folded into the int4
checkpoint's float weights).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from noisy_temp_server.calibration.profile import ProfileError

if TYPE_CHECKING:
    from noisy_temp_server.settings import Settings

__all__ = ["STACK_ADAPTER_RANK", "STACK_PROFILE", "stack_settings"]

_LOGGER = logging.getLogger("noisy_temp_server.serve")

STACK_ADAPTER_RANK = 64
STACK_PROFILE = "profile.json"
_STACK_SPEC_JSON = '{"kind": "quantization", "format": "int4", "group_size": 128}'
_CONFLICTING = ("served_model", "clean_model", "profile", "adapter")


def _calibrate(served: Path, clean: Path, cache_dir: Path, out: Path) -> None:
    """Run `calibrate` on the pair with a rank-`STACK_ADAPTER_RANK` adapter into `out`;
    ProfileError if it fails."""
    from noisy_temp_server.commands import calibrate  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    argv = ["--served", str(served), "--clean", str(clean), "--cache-dir", str(cache_dir),
            "--out", str(out), "--adapter-rank", str(STACK_ADAPTER_RANK)]  # fmt: skip
    if calibrate.run(parser.parse_args(argv)) != 0 or not out.is_file():
        raise ProfileError("calibrating the int4 stack failed (see the lines above)")


def ensure_stack_profile(served: Path, clean: Path, cache_dir: Path) -> Path:
    """The int4 stack's profile for `served` (its adapter beside it), from the cache, or
    calibrated now and cached (written beside its folder, then renamed into place)."""
    folder = cache_dir / "stacks" / f"{served.name}-r{STACK_ADAPTER_RANK}"
    if (folder / STACK_PROFILE).is_file():
        return folder / STACK_PROFILE
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _LOGGER.info("Calibrating the int4 stack once (adapter rank %d) ...", STACK_ADAPTER_RANK)
        _calibrate(served, clean, cache_dir, staging / STACK_PROFILE)
        try:
            staging.rename(folder)
        except OSError:  # another server cached it meanwhile
            if not (folder / STACK_PROFILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder / STACK_PROFILE


def stack_settings(settings: Settings) -> Settings:
    """`settings` with the int4 stack's served model, clean model and profile filled in (they
    are returned unchanged unless `settings.int4_stack`). ProfileError when they name a pair
    or a profile of their own (the stack is its own pair), or when calibrating fails."""
    if not settings.int4_stack:
        return settings
    given = [name for name in _CONFLICTING if getattr(settings, name) is not None]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ProfileError(f"--int4-stack serves its own pair and profile; drop {flags}")
    from noisy_temp_server.pairs.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbation import parse_spec  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbed_checkpoint import (  # noqa: PLC0415
        ensure_perturbed_checkpoint,
    )

    clean = ensure_default_model(settings.cache_dir)
    served = ensure_perturbed_checkpoint(clean, parse_spec(_STACK_SPEC_JSON), settings.cache_dir)
    profile = ensure_stack_profile(served, clean, settings.cache_dir)
    return settings.model_copy(
        update={"served_model": served, "clean_model": clean, "profile": profile}
    )
