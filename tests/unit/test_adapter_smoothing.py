"""A smoothed pair (AWQ-style scales moved from norms and linear layers into the layers that
read them, then rounded): the adapter is fitted in the served model's basis, where it removes
the rounding error as on an unsmoothed pair; fitted in the clean basis it cannot. The clean
weights are put back, and a pair that differs beyond the decoder's linear layers and norms is
refused in one line."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from noisy_temp_server.adapter import layer_fit
from noisy_temp_server.adapter.layer_fit import applied_deltas, fit_compensation_adapter
from noisy_temp_server.adapter.smoothing import LINEAR_READERS, NORM_READERS, served_basis
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec, apply_perturbation
from noisy_temp_server.scoring.sequence import ScoringSequence

INT4 = QuantizationSpec(format="int4", group_size=32)
RANK = 8


@torch.no_grad()
def _smoothed(model: nn.Module, seed: int = 0) -> nn.Module:
    """`model` with per-channel scales moved as AWQ moves them (its function unchanged)."""
    smoothed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for block in smoothed.model.layers:
        modules = dict(block.named_modules())
        for norm, readers in NORM_READERS:
            scales = torch.exp(0.7 * torch.randn(modules[norm].weight.shape, generator=generator))
            modules[norm].weight.div_(scales)
            for reader in readers:
                modules[reader].weight.mul_(scales)
        writer, reader = LINEAR_READERS[1]  # up -> down (v -> o: grouped-query, widths differ)
        scales = torch.exp(0.7 * torch.randn(modules[writer].out_features, generator=generator))
        modules[writer].weight.div_(scales[:, None])
        modules[reader].weight.mul_(scales[None, :])
    return smoothed


def _sequences(count: int, seed: int) -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(seed)
    return [
        ScoringSequence(torch.randint(3, 512, (48,), generator=generator).tolist(), 8, i)
        for i in range(count)
    ]


@torch.no_grad()
def _mean_kl(clean: nn.Module, served: nn.Module, deltas: dict, sequences: list) -> float:
    ids = torch.tensor([s.token_ids for s in sequences])
    reference = torch.log_softmax(clean(input_ids=ids).logits.double(), dim=-1)
    with applied_deltas(served, deltas):
        logits = torch.log_softmax(served(input_ids=ids).logits.double(), dim=-1)
    return float((reference.exp() * (reference - logits)).sum(-1)[:, 8:].mean())


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(clean, clean rounded to int4, clean smoothed then rounded to int4)."""
    clean, _ = load_causal_lm(tiny_model_dir)
    rounded = copy.deepcopy(clean)
    apply_perturbation(rounded, INT4)
    smoothed = _smoothed(clean)
    test = _sequences(4, seed=1)
    assert _mean_kl(clean, smoothed, {}, test) < 1e-8  # the same function, another basis
    apply_perturbation(smoothed, INT4)
    return clean, rounded, smoothed


def _fit_in_the_clean_basis(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, the adapter is fitted without rewriting the clean model."""

    @contextmanager
    def clean_basis(*_: object) -> Iterator[bool]:
        yield False

    monkeypatch.setattr(layer_fit, "served_basis", clean_basis)


def _share_removed(clean: nn.Module, served: nn.Module) -> float:
    fit, test = _sequences(16, seed=0), _sequences(8, seed=1)
    adapter = fit_compensation_adapter(clean, served, fit, rank=RANK, ridge=1.0)
    before = _mean_kl(clean, served, {}, test)
    return 1.0 - _mean_kl(clean, served, adapter.layers, test) / before


def test_a_smoothed_pair_is_fitted_in_the_served_basis_as_well_as_a_plain_one(
    models: tuple[nn.Module, nn.Module, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean, rounded, smoothed = models
    weights = {name: p.clone() for name, p in clean.named_parameters()}
    plain_share = _share_removed(clean, rounded)
    smoothed_share = _share_removed(clean, smoothed)
    assert plain_share > 0.3
    assert smoothed_share > 0.6 * plain_share
    for name, parameter in clean.named_parameters():
        assert torch.equal(parameter, weights[name]), name

    _fit_in_the_clean_basis(monkeypatch)
    assert _share_removed(clean, smoothed) < 0.5 * smoothed_share


def test_a_pair_differing_beyond_the_linear_layers_and_norms_is_refused(
    models: tuple[nn.Module, nn.Module, nn.Module],
) -> None:
    clean, rounded, _ = models
    served = copy.deepcopy(rounded)
    with torch.no_grad():
        served.model.embed_tokens.weight.copy_(clean.model.embed_tokens.weight.half().float())
    fit_compensation_adapter(clean, served, _sequences(2, seed=0), rank=RANK)  # fp16 rounding
    with torch.no_grad():
        served.model.embed_tokens.weight.mul_(1.02)
    with pytest.raises(
        ValueError, match=r"served model's model.embed_tokens.weight differs from the clean"
    ):
        fit_compensation_adapter(clean, served, _sequences(2, seed=0), rank=RANK)


def test_an_unsmoothed_pair_is_left_in_its_basis(
    models: tuple[nn.Module, nn.Module, nn.Module],
) -> None:
    clean, rounded, _ = models
    with served_basis(clean.model.layers, rounded.model.layers) as smoothed:
        assert not smoothed


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"


@pytest.mark.parametrize("fixture", ["awq-gemm-4bit-g32", "ct-awq-w4a16-asym"])
def test_real_awq_checkpoints_are_fitted_better_in_their_basis(
    models: tuple[nn.Module, nn.Module, nn.Module], fixture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model quantized by GPTQModel's and llm-compressor's AWQ (which smooth it)."""
    clean = models[0]
    served, _ = load_causal_lm(FIXTURES / fixture, verify=False)
    in_served_basis = _share_removed(clean, served)

    _fit_in_the_clean_basis(monkeypatch)
    assert in_served_basis > 0.3
    assert in_served_basis > 1.1 * _share_removed(clean, served)


@torch.no_grad()
def test_the_rewrite_leaves_the_clean_function_and_puts_the_weights_back(
    models: tuple[nn.Module, nn.Module, nn.Module],
) -> None:
    clean, _, smoothed = models
    ids = torch.tensor([_sequences(1, seed=3)[0].token_ids])
    weights = {name: p.clone() for name, p in clean.named_parameters()}
    reference = clean(input_ids=ids).logits
    with served_basis(clean.model.layers, smoothed.model.layers) as moved:
        assert moved
        assert not torch.equal(clean.model.layers[0].input_layernorm.weight, weights[
            "model.layers.0.input_layernorm.weight"])  # fmt: skip
        torch.testing.assert_close(clean(input_ids=ids).logits, reference, rtol=1e-4, atol=1e-4)
    for name, parameter in clean.named_parameters():
        assert torch.equal(parameter, weights[name]), name


class _OnePlusNorm(nn.Module):
    """A norm that multiplies by 1 + w (Gemma's), which moved scales cannot describe."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


@torch.no_grad()
def test_norms_that_do_not_multiply_by_their_weight_are_refused_in_one_line(
    models: tuple[nn.Module, nn.Module, nn.Module],
) -> None:
    clean, _, smoothed = (copy.deepcopy(model) for model in models)
    for model in (clean, smoothed):
        for block in model.model.layers:
            block.input_layernorm = _OnePlusNorm(block.input_layernorm.weight)
    weights = {name: p.clone() for name, p in clean.named_parameters()}
    with (
        pytest.raises(ValueError, match="differs from the clean one's by more than moved scales"),
        served_basis(clean.model.layers, smoothed.model.layers),
    ):
        pass
    for name, parameter in clean.named_parameters():
        assert torch.equal(parameter, weights[name]), name
