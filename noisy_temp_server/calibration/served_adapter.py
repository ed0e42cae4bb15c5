"""Which compensation adapter a profile serves: the one it names and recommends, found beside
it, or the PEFT folder the user gives (`--adapter`), checked against the profile.

A profile's T* and bias were fitted on the served model with its adapter (when one is
recommended), so a given adapter is accepted with a profile only if it is that adapter.
"""

from __future__ import annotations

import logging
from pathlib import Path

from noisy_temp_server.adapter.lora import (
    AdapterError,
    LoraAdapter,
    adapter_sha256,
    find_adapter,
    load_peft_adapter,
)
from noisy_temp_server.adapter.serving import CalibratedKl
from noisy_temp_server.calibration.profile import AdapterSummary, Profile

__all__ = ["adapter_to_serve", "calibrated_kl", "profile_adapter"]

_LOGGER = logging.getLogger("noisy_temp_server.serve")


def _check_against_profile(adapter: LoraAdapter, summary: AdapterSummary) -> None:
    """AdapterError unless the adapter's files are the one the profile describes."""
    found = (adapter.rank, tuple(adapter.target_modules), len(adapter.layers))
    wanted = (summary.rank, tuple(sorted(summary.target_modules)), summary.layers)
    if found != wanted:
        raise AdapterError(
            f"the adapter has rank {found[0]}, modules {list(found[1])} and {found[2]} layers, "
            f"but the profile names rank {wanted[0]}, modules {list(wanted[1])} and "
            f"{wanted[2]} layers"
        )


def _found_adapter(profile: Profile, folder: Path) -> tuple[Path, LoraAdapter] | None:
    """The adapter `profile` names and recommends, found in `folder` (the profile's), with its
    own folder; None when it names none or does not recommend it. AdapterError when it is
    missing, unreadable, not the one hashed or not the one described."""
    summary = profile.adapter
    if summary is None:
        return None
    if not summary.recommended:
        _LOGGER.info("Serving without the profile's adapter %s: not recommended", summary.sha256)
        return None
    found = find_adapter([folder], summary.sha256)
    _check_against_profile(found[1], summary)
    return found


def _given_adapter(folder: Path, profile: Profile | None) -> tuple[Path, LoraAdapter]:
    """The adapter of `--adapter` (a PEFT folder); AdapterError if unreadable, or if there is a
    profile that was not calibrated with this adapter recommended (its T* and bias correct the
    served model as it was calibrated, not with another adapter under them)."""
    adapter = load_peft_adapter(folder)
    if profile is None:
        return folder, adapter
    summary = profile.adapter
    if summary is None or not summary.recommended:
        raise AdapterError(
            f"the profile was calibrated without an adapter, so its T* and bias do not fit the "
            f"model with {folder}; calibrate with --adapter-rank, or serve the adapter without "
            "a profile"
        )
    if summary.sha256 != adapter_sha256(adapter):
        raise AdapterError(
            f"the profile was calibrated with the adapter {summary.sha256[:16]}..., not with "
            f"{folder}"
        )
    return folder, adapter


def adapter_to_serve(
    profile: Profile | None, profile_path: Path | None, given: Path | None
) -> tuple[Path, LoraAdapter] | None:
    """The adapter to serve and its folder: `given` (a PEFT folder) when not None, else the
    one `profile` (loaded from `profile_path`) names and recommends; None when there is none.
    AdapterError naming the problem (see `_found_adapter` and `_given_adapter`)."""
    if given is not None:
        return _given_adapter(given, profile)
    if profile is None or profile_path is None:
        return None
    return _found_adapter(profile, profile_path.parent)


def profile_adapter(profile: Profile, folder: Path) -> LoraAdapter | None:
    """The adapter `profile` names and recommends, read from `folder` (the profile's); None
    when there is none. AdapterError as `adapter_to_serve`."""
    found = _found_adapter(profile, folder)
    return None if found is None else found[1]


def calibrated_kl(profile: Profile | None) -> CalibratedKl | None:
    """What the profile's calibration measured the adapter to remove on its test prompts."""
    summary = None if profile is None else profile.adapter
    if summary is None:
        return None
    return CalibratedKl(summary.test.baseline_kl, summary.test.mean_kl)
