"""The lean served model (`checkpoints.lean_served`): a quantized folder loaded beside its clean
model with its layers packed and its equal tensors shared, on the real quantizers' fixtures
(tests/fixtures/quantized/, made from the tiny Llama of seed 0)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from noisy_temp_server.adapter.layer_fit import fit_compensation_adapter
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.lean_served import PackedLinear, load_lean_served
from noisy_temp_server.checkpoints.loading import ServedWeights, load_pair
from noisy_temp_server.scoring.sequence import ScoringSequence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"
WEIGHT_ONLY = (
    "ct-gptq-w4a16",
    "ct-gptq-w4a16-actorder",
    "ct-awq-w4a16-asym",
    "gptq-4bit-g32",
    "gptq-4bit-g32-actorder",
    "gptq-8bit-perchannel-v2",
    "awq-gemm-4bit-g32",
)
ACTIVATIONS_QUANTIZED = ("ct-w8a8-int8", "ct-fp8-dynamic")


@pytest.fixture(scope="module")
def clean(tiny_model_dir: Path) -> nn.Module:
    return load_causal_lm(tiny_model_dir)[0]


def _ids(seed: int, length: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (1, length), generator=generator)


def _own_bytes(model: nn.Module, clean: nn.Module) -> int:
    """Bytes of the tensors `model` holds that are not `clean`'s."""
    shared = {id(t) for t in [*clean.parameters(), *clean.buffers()]}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in shared}
    return sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_the_lean_model_computes_the_whole_loaded_ones_logits(
    name: str, tiny_model_dir: Path, clean: nn.Module
) -> None:
    whole = load_causal_lm(FIXTURES / name)[0]
    lean = load_lean_served(FIXTURES / name, tiny_model_dir, clean)
    assert lean is not None
    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(lean(_ids(seed)).logits, whole(_ids(seed)).logits)


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_packed_layers_hold_no_float_weight_and_equal_tensors_are_shared(
    name: str, tiny_model_dir: Path, clean: nn.Module
) -> None:
    lean = load_lean_served(FIXTURES / name, tiny_model_dir, clean)
    assert lean is not None
    decoder_linears = [
        m for n, m in lean.named_modules() if ".layers." in n and isinstance(m, nn.Linear)
    ]
    assert decoder_linears
    assert all(isinstance(m, PackedLinear) for m in decoder_linears)
    assert not any(
        p.dtype.is_floating_point and p.numel() == m.in_features * m.out_features
        for m in decoder_linears
        for p in m.buffers()
    )
    clean_parameters = dict(clean.named_parameters())
    assert any(p is clean_parameters[n] for n, p in lean.named_parameters())
    for parameter_name, parameter in lean.named_parameters():
        reference = clean_parameters[parameter_name]
        assert (parameter is reference) == torch.equal(parameter, reference), parameter_name
    # the served model's own bytes: its packed layers (under 0.4 of their float32 weights) and
    # the parameters that differ from the clean ones, nothing else
    packed = sum(b.nbytes for m in decoder_linears for b in m.buffers())
    assert packed < 0.4 * sum(4 * m.in_features * m.out_features for m in decoder_linears)
    differing = sum(p.nbytes for n, p in lean.named_parameters() if p is not clean_parameters[n])
    assert _own_bytes(lean, clean) == packed + differing


@pytest.mark.parametrize("name", ACTIVATIONS_QUANTIZED)
def test_activation_quantized_schemes_are_loaded_whole(
    name: str, tiny_model_dir: Path, clean: nn.Module
) -> None:
    assert load_lean_served(FIXTURES / name, tiny_model_dir, clean) is None
    pair = load_pair(tiny_model_dir, served_path=FIXTURES / name)
    assert not any(isinstance(m, PackedLinear) for m in pair.served_model.modules())


def test_a_float_folder_is_not_lean(tiny_model_dir: Path, clean: nn.Module) -> None:
    assert load_lean_served(tiny_model_dir, tiny_model_dir, clean) is None


def test_a_served_config_that_differs_beyond_quantization_is_loaded_whole(
    tmp_path: Path, tiny_model_dir: Path, clean: nn.Module
) -> None:
    folder = tmp_path / "served"
    shutil.copytree(FIXTURES / "ct-gptq-w4a16", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 1234.0
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert load_lean_served(folder, tiny_model_dir, clean) is None


def test_load_pair_shares_the_clean_models_tensors(tiny_model_dir: Path) -> None:
    pair = load_pair(
        tiny_model_dir, served_path=FIXTURES / "ct-gptq-w4a16", served_weights="packed"
    )
    served, clean_model = pair.served_model, pair.clean_model
    assert any(isinstance(m, PackedLinear) for m in served.modules())
    assert served.get_input_embeddings().weight is clean_model.get_input_embeddings().weight


def _sequences(count: int) -> list[ScoringSequence]:
    return [ScoringSequence(_ids(seed, 16)[0].tolist(), 4, seed) for seed in range(count)]


@pytest.mark.parametrize("name", ["ct-awq-w4a16-asym", "gptq-4bit-g32-actorder"])
def test_the_fit_on_the_lean_model_is_the_fit_on_the_whole_one(
    name: str, tiny_model_dir: Path, clean: nn.Module
) -> None:
    """The AWQ fixture is smoothed: its clean blocks are rewritten, one at a time, and put back."""
    before = {n: p.detach().clone() for n, p in clean.named_parameters()}
    whole = load_causal_lm(FIXTURES / name)[0]
    lean = load_lean_served(FIXTURES / name, tiny_model_dir, clean)
    assert lean is not None
    sequences = _sequences(4)
    expected = fit_compensation_adapter(clean, whole, sequences, rank=4, ridge=3.0)
    found = fit_compensation_adapter(clean, lean, sequences, rank=4, ridge=3.0)
    assert expected.layers.keys() == found.layers.keys()
    for layer, delta in expected.layers.items():
        assert torch.equal(found.layers[layer].up, delta.up), layer
        assert torch.equal(found.layers[layer].down, delta.down), layer
    for parameter_name, parameter in clean.named_parameters():
        assert torch.equal(parameter, before[parameter_name]), parameter_name


def test_a_packed_layers_input_gradient_is_the_float_layers(
    tiny_model_dir: Path, clean: nn.Module
) -> None:
    lean = load_lean_served(FIXTURES / "ct-gptq-w4a16", tiny_model_dir, clean)
    assert lean is not None
    packed = next(m for m in lean.modules() if isinstance(m, PackedLinear))
    float_layer = nn.Linear(packed.in_features, packed.out_features, bias=False)
    float_layer.weight.data.copy_(packed.weight)
    x = torch.randn(3, packed.in_features, generator=torch.Generator().manual_seed(0))
    gradients = []
    for layer in (packed, float_layer):
        given = x.clone().requires_grad_(True)
        layer(given).square().sum().backward()
        gradients.append(given.grad)
    assert torch.allclose(gradients[0], gradients[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("served_weights", "packed"), [("packed", True), ("float", False)])
def test_load_pair_loads_the_served_weights_as_asked(
    served_weights: ServedWeights, packed: bool, tiny_model_dir: Path
) -> None:
    pair = load_pair(
        tiny_model_dir, served_path=FIXTURES / "ct-gptq-w4a16", served_weights=served_weights
    )
    assert any(isinstance(m, PackedLinear) for m in pair.served_model.modules()) == packed


def test_auto_packs_the_served_model_when_memory_is_short(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    from noisy_temp_server.checkpoints import loading  # noqa: PLC0415

    folder = FIXTURES / "ct-gptq-w4a16"
    assert not any(
        isinstance(m, PackedLinear)
        for m in load_pair(tiny_model_dir, served_path=folder).served_model.modules()
    )
    monkeypatch.setattr(loading, "_available_bytes", lambda _: 1000)
    pair = load_pair(tiny_model_dir, served_path=folder)
    assert any(isinstance(m, PackedLinear) for m in pair.served_model.modules())


def test_a_packed_layer_with_a_bias_computes_as_a_linear_layer() -> None:
    generator = torch.Generator().manual_seed(0)
    reference = nn.Linear(8, 5)
    codes = torch.randint(-8, 8, (5, 8), generator=generator, dtype=torch.int8)
    with torch.no_grad():
        reference.weight.copy_(codes.float() * 0.1)
    layer = PackedLinear(
        {"codes": codes}, lambda p: p["codes"].float() * 0.1, (5, 8), torch.float32, reference.bias
    )
    x = torch.randn(3, 8, generator=generator)
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x))
    assert not any(name == "weight" for name, _ in layer.named_parameters())
