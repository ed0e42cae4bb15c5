"""A served checkpoint and a compensation adapter (`adapter.lora`): what its weights are
(floats that an adapter can be folded into, or quantized kernels that need vLLM's LoRA), the
shapes of its linear layers, and the folded checkpoint, written once to the cache.

The folded checkpoint computes what the served checkpoint with the adapter computes, with no
per-step cost: ``cache_dir/folded/<served name>-<served weights sha256[:12]>-<adapter folder>``,
its manifest recording the served checkpoint's metadata (its perturbation, its clean model) and
the adapter folded in (``folded_adapter``), so that nothing folds it twice.
"""

from __future__ import annotations

from pathlib import Path

import torch

from noisy_temp_server.adapter.lora import (
    AdapterError,
    LoraAdapter,
    adapter_folder_name,
    adapter_sha256,
    fold_adapter,
)
from noisy_temp_server.checkpoints.checkpoint import (
    MANIFEST_FILENAME,
    load_causal_lm,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.model_folder import read_config

__all__ = [
    "FOLDED_ADAPTER_KEY",
    "ensure_folded_checkpoint",
    "folded_adapter_of",
    "holds_quantized_kernels",
    "linear_shapes",
    "quantization_format",
]

FOLDED_ADAPTER_KEY = "folded_adapter"
"""The manifest metadata key of a folded checkpoint: the sha256 of the adapter folded in."""


def holds_quantized_kernels(path: Path) -> bool:
    """Whether the checkpoint folder `path` stores quantized weights that vLLM runs with its own
    kernels (a ``quantization_config`` in its ``config.json``: compressed-tensors, AWQ, GPTQ),
    into which no adapter can be folded. ModelFolderError if its configuration is unreadable."""
    return read_config(path).get("quantization_config") is not None


def quantization_format(path: Path) -> str | None:
    """The storage format of the quantized checkpoint folder `path` (compressed-tensors'
    ``format``: ``int-quantized`` for w8a8, ``pack-quantized`` for w4a16, ...; else the
    ``quant_method``); None for float weights."""
    config = read_config(path).get("quantization_config")
    if not isinstance(config, dict):
        return None
    return str(config.get("format") or config.get("quant_method") or "unknown")


def linear_shapes(path: Path) -> dict[str, tuple[int, int]]:
    """Module path -> (out_features, in_features) of every linear layer of the model in the
    checkpoint folder `path`, as transformers builds it from ``config.json`` (on the meta device:
    nothing is loaded; quantized weights count at their unpacked shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the layers' shapes, not the quantized modules
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {
        name: (int(module.out_features), int(module.in_features))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def folded_adapter_of(path: Path) -> str | None:
    """The sha256 of the adapter folded into the checkpoint folder `path` (None: none)."""
    recorded = _manifest_metadata(path).get(FOLDED_ADAPTER_KEY)
    return recorded if isinstance(recorded, str) else None


def _manifest_metadata(path: Path) -> dict[str, object]:
    """The metadata of a checkpoint of ours (empty for a plain folder, which has none)."""
    return dict(read_manifest(path).metadata) if (path / MANIFEST_FILENAME).is_file() else {}


def _weights_sha256(path: Path, cache_dir: Path) -> str:
    """The served weights' identity (a plain folder's content hash, cached in `cache_dir`)."""
    sha256 = ModelIdentity.of_checkpoint(path, cache_dir).weights_sha256
    assert sha256 is not None  # a folder's weights always have one
    return sha256


def _checkpoint_dtype(path: Path) -> torch.dtype:
    config = read_config(path)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def ensure_folded_checkpoint(served: Path, adapter: LoraAdapter, cache_dir: Path) -> Path:
    """The checkpoint of `served` with `adapter` folded into its weights, from the cache.

    Written once (atomically, `save_checkpoint`) under ``cache_dir/folded/`` named by the
    served weights' sha256 and the adapter's; later calls reuse it after the fast integrity
    check (CorruptCheckpointError if it is damaged). Kept in the served checkpoint's dtype;
    the fold itself is computed in float32 (`fold_adapter`). Raises AdapterError for quantized
    weights (`holds_quantized_kernels`), for a checkpoint that already has an adapter folded in,
    and for an adapter that does not fit the served model's layers.
    """
    if holds_quantized_kernels(served):
        raise AdapterError(f"{served} holds quantized kernels: an adapter cannot be folded in")
    metadata = _manifest_metadata(served)
    already = folded_adapter_of(served)
    if already is not None:
        raise AdapterError(
            f"{served} already has the adapter {already[:16]}... folded in; serve the "
            "checkpoint it was folded from"
        )
    sha256 = adapter_sha256(adapter)
    weights = _weights_sha256(served, cache_dir)[:12]
    dest = cache_dir / "folded" / f"{served.resolve().name}-{weights}-{adapter_folder_name(sha256)}"
    if dest.exists():
        verify_checkpoint(dest, full=False)
        return dest
    model, tokenizer = load_causal_lm(served, dtype=_checkpoint_dtype(served))
    fold_adapter(dict(model.named_parameters()), adapter)
    try:
        save_checkpoint(
            dest,
            model,
            tokenizer,
            kind="folded",
            description=f"{served.resolve().name} with the adapter {sha256[:16]}... folded in",
            source=f"noisy-temp-server serve: {served} with its profile's adapter folded in",
            metadata={**metadata, FOLDED_ADAPTER_KEY: sha256},
        )
    except FileExistsError:  # another server wrote the same folder meanwhile
        verify_checkpoint(dest, full=False)
    return dest
