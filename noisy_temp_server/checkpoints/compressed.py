"""Real quantized checkpoints in the compressed-tensors format, which vLLM runs with its kernels.

Unlike the round-to-nearest *simulations* of `noisy_temp_server.checkpoints.perturbation` (weights
quantized and dequantized back to float, served as an ordinary float model), a checkpoint
written here stores the quantized weights (int8, packed int4 or fp8) with their scales and a
`quantization_config` in `config.json`; vLLM serves it with its own quantized kernels, and
transformers loads it (via compressed-tensors) and decompresses it, which is how the pair
scorer's served pass reads it.

Weights of every `Linear` layer except the output head are quantized by round-to-nearest with
min-max scales (per output channel, or per group of input channels): no calibration data, no
GPTQ/AWQ. Activation quantization, where the scheme has one, is dynamic (per token), so it
needs no calibration either. Schemes (`COMPRESSED_SCHEMES`):

- `w8a8`: int8 weights per channel, int8 activations per token (vLLM CPU: oneDNN/AMX kernels);
- `w4a16`: int4 weights in groups of `group_size` input channels, 16/32-bit activations
  (vLLM CPU: its WNA16 kernel, which needs layer sizes that are multiples of 32);
- `fp8`: fp8 (e4m3) weights per channel, fp8 activations per token. vLLM runs it on GPUs
  (compute capability >= 8.9 for fp8 activations; Marlin W8A16 on older ones); its CPU build
  has fp8 kernels only on some CPUs, so tests on CPU use `w8a8` and `w4a16`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from noisy_temp_server.checkpoints.checkpoint import (
    CheckpointManifest,
    load_causal_lm,
    save_checkpoint,
)
from noisy_temp_server.checkpoints.identity import ModelIdentity

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["COMPRESSED_SCHEMES", "quantize_model", "write_compressed_checkpoint"]

# scheme -> (compressed-tensors preset, storage format)
COMPRESSED_SCHEMES: dict[str, tuple[str, str]] = {
    "w8a8": ("W8A8", "int-quantized"),
    "w4a16": ("W4A16", "pack-quantized"),
    "fp8": ("FP8_DYNAMIC", "float-quantized"),
}
_IGNORED = ["lm_head"]


def _scheme(name: str, group_size: int) -> Any:
    from compressed_tensors.quantization import (  # type: ignore[import-untyped]  # noqa: PLC0415
        preset_name_to_scheme,
    )

    if name not in COMPRESSED_SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; one of: {', '.join(COMPRESSED_SCHEMES)}")
    scheme = preset_name_to_scheme(COMPRESSED_SCHEMES[name][0], ["Linear"])
    if scheme.weights is not None and scheme.weights.group_size is not None:
        scheme.weights = scheme.weights.model_copy(update={"group_size": group_size})
    return scheme


def _set_weight_qparams(module: Any) -> None:
    """Min-max scales and zero points of `module.weight` for its scheme's weight arguments
    (`module`: a Linear layer prepared by `apply_quantization_config`)."""
    from compressed_tensors.quantization.utils import (  # type: ignore[import-untyped]  # noqa: PLC0415
        calculate_qparams,
    )

    args = module.quantization_scheme.weights
    weight: torch.Tensor = module.weight.data.float()
    group_size: int | None = args.group_size
    if group_size is not None:
        rows, columns = weight.shape
        if columns % group_size:
            raise ValueError(
                f"group size {group_size} does not divide the {columns} input channels of "
                f"a {rows}x{columns} layer; pass a group size that does"
            )
        weight = weight.reshape(rows, columns // group_size, group_size)
    low, high = weight.amin(dim=-1), weight.amax(dim=-1)
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def quantize_model(model: PreTrainedModel, scheme: str, *, group_size: int = 128) -> int:
    """Quantize `model`'s Linear layers (not the output head) in place and compress them.

    Afterwards `model.config.quantization_config` holds the compressed-tensors configuration
    and the state dict the quantized tensors, so `save_pretrained` writes a compressed-tensors
    checkpoint. Returns the number of quantized layers. ValueError for an unknown scheme or a
    group size that does not divide a layer's input channels.
    """
    import compressed_tensors  # type: ignore[import-untyped]  # noqa: PLC0415
    from compressed_tensors.compressors import (  # type: ignore[import-untyped]  # noqa: PLC0415
        ModelCompressor,
    )
    from compressed_tensors.quantization import (  # noqa: PLC0415
        QuantizationConfig,
        apply_quantization_config,
    )

    config = QuantizationConfig(
        config_groups={"group_0": _scheme(scheme, group_size)}, ignore=list(_IGNORED)
    )
    apply_quantization_config(model, config)
    quantized = [m for m in model.modules() if hasattr(m, "weight_scale")]
    for module in quantized:
        _set_weight_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format=COMPRESSED_SCHEMES[scheme][1]
    )
    compressor.compress_model(model)
    assert compressor.quantization_config is not None
    model.config.quantization_config = {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        **compressor.quantization_config.model_dump(exclude={"quant_method"}),
    }
    return len(quantized)


def write_compressed_checkpoint(
    clean_dir: Path,
    scheme: str,
    dest: Path,
    *,
    group_size: int = 128,
    replace: bool = False,
    cache_dir: Path | None = None,
) -> CheckpointManifest:
    """Write `clean_dir` quantized by `scheme` to `dest` (atomically); return its manifest.

    The manifest records the scheme (metadata "compressed_tensors") and the clean model's
    identity (metadata "clean"), so `calibrate`, `kld` and `serve` pair it with its clean model.
    The output is deterministic: the same inputs give byte-identical weights. A plain clean
    folder's identity is cached in `cache_dir` (default: the product's cache).
    """
    clean_identity = ModelIdentity.of_checkpoint(clean_dir, cache_dir)
    model, tokenizer = load_causal_lm(clean_dir)
    layers = quantize_model(model, scheme, group_size=group_size)
    clean_name = clean_identity.name
    details: dict[str, Any] = {"scheme": scheme, "layers": layers}
    if _scheme(scheme, group_size).weights.group_size is not None:
        details["group_size"] = group_size
    return save_checkpoint(
        dest,
        model,
        tokenizer,
        kind="quantized",
        description=f"{clean_name} quantized to compressed-tensors {scheme}",
        source=f"noisy-temp-server quantize: {clean_name}, round-to-nearest min-max scales",
        metadata={
            "compressed_tensors": details,
            "clean": {"name": clean_name, "weights_sha256": clean_identity.weights_sha256},
        },
        replace=replace,
    )
