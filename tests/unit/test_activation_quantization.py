"""A checkpoint's input quantization emulated in the scored forward
(`checkpoints.activation_quantization`), on fixtures written by llm-compressor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization.lifecycle.forward import (  # type: ignore[import-untyped]
    forward_quantize,
)

from noisy_temp_server.checkpoints.activation_quantization import emulate_input_quantization
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from tests.tiny_model import build_tiny_llama

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"
IDS = torch.tensor([list(range(5, 40))])


def test_w8a8_layers_read_their_inputs_quantized_as_the_scheme_says() -> None:
    """What a W8A8 layer reads is its raw input quantized by the scheme's own quantizer
    (per-token int8): a few distinct values per row, not the float input."""
    model, _ = load_causal_lm(FIXTURES / "ct-w8a8-int8")
    layer = model.get_submodule("model.layers.1.mlp.down_proj")
    raw: list[torch.Tensor] = []
    read: list[torch.Tensor] = []
    layer.register_forward_pre_hook(lambda m, i: raw.append(i[0]), prepend=True)
    layer.register_forward_hook(lambda m, i, o: read.append(i[0]))
    with torch.no_grad():
        model(IDS)
    args: Any = layer.quantization_scheme.input_activations  # type: ignore[union-attr]
    assert (args.type, args.num_bits, args.strategy) == ("int", 8, "token")
    torch.testing.assert_close(read[0], forward_quantize(layer, raw[0], "input", args))
    assert not torch.allclose(read[0], raw[0])
    assert all(len(row.unique()) <= 256 for row in read[0].reshape(-1, read[0].shape[-1]))


def test_w8a8_forward_differs_from_the_weight_only_one() -> None:
    model, _ = load_causal_lm(FIXTURES / "ct-w8a8-int8")
    with torch.no_grad():
        emulated = model(IDS).logits
    for module in model.modules():
        module._forward_pre_hooks.clear()
    with torch.no_grad():
        weight_only = model(IDS).logits
    assert (emulated - weight_only).abs().max() > 1e-3


def test_weight_only_and_float_models_are_left_alone(tmp_path: Path) -> None:
    float_model, _ = load_causal_lm(build_tiny_llama(tmp_path / "clean", seed=0))
    gptq, _ = load_causal_lm(FIXTURES / "ct-gptq-w4a16")
    assert emulate_input_quantization(float_model) == 0
    assert emulate_input_quantization(gptq) == 0
