"""A quantized checkpoint's input quantization, emulated in the forward the scorer runs.

A compressed-tensors checkpoint whose scheme also quantizes the linear layers' inputs (W8A8:
dynamic per-token int8; FP8-dynamic: per-token fp8) is served by vLLM's kernels on quantized
inputs, but transformers decompresses its weights and runs the layers on float inputs.
`emulate_input_quantization` makes a loaded model quantize each such layer's input as its
scheme says, with compressed-tensors' own `forward_quantize`, so that scoring, calibration and
the adapter's fit see what is served (docs/quantized_checkpoints.md measures the difference).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor, nn

__all__ = ["emulate_input_quantization"]


def _input_arguments(module: nn.Module) -> Any:
    """The compressed-tensors arguments of `module`'s input quantization, or None."""
    return getattr(getattr(module, "quantization_scheme", None), "input_activations", None)


def _quantize_input(
    forward_quantize: Callable[..., Tensor], module: nn.Module, inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    args = _input_arguments(module)
    if args is None or not inputs or not isinstance(inputs[0], Tensor):
        return inputs
    return (forward_quantize(module, inputs[0], "input", args), *inputs[1:])


def emulate_input_quantization(model: nn.Module) -> int:
    """Hook every module of `model` whose compressed-tensors scheme (the `quantization_scheme`
    transformers attaches when it loads such a checkpoint) quantizes its input, so that its
    forward quantizes the input as the scheme says (dynamic scales computed per call; static
    ones read from the module). Returns how many modules were hooked: 0 for a model without
    such a scheme (float, weight-only, GPTQ/AWQ formats), which is left as it was."""
    modules = [module for module in model.modules() if _input_arguments(module) is not None]
    if not modules:
        return 0
    from compressed_tensors.quantization.lifecycle.forward import (  # type: ignore[import-untyped]  # noqa: PLC0415
        forward_quantize,
    )

    for module in modules:
        module.register_forward_pre_hook(partial(_quantize_input, forward_quantize))
    return len(modules)
