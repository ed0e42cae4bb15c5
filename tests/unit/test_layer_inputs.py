"""The compensation adapter's block-by-block fit on the tiny model and its int4 copy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from noisy_temp_server.adapter.deltas import svd_delta
from noisy_temp_server.adapter.layer_fit import (
    _first_block_inputs,
    _stages,
    adapter_targets,
    fit_compensation_adapter,
    perturbed_linears,
)
from noisy_temp_server.adapter.lora import fold_adapter
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.compressed import write_compressed_checkpoint
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec, apply_perturbation
from noisy_temp_server.scoring.sequence import ScoringSequence


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    clean, _ = load_causal_lm(tiny_model_dir)
    served = copy.deepcopy(clean)
    apply_perturbation(served, QuantizationSpec(format="int4", group_size=32))
    return clean, served


def _sequences(count: int, seed: int) -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(seed)
    return [
        ScoringSequence(torch.randint(3, 500, (48,), generator=generator).tolist(), 8, i)
        for i in range(count)
    ]


@torch.no_grad()
def _mean_kl(
    clean: torch.nn.Module, served: torch.nn.Module, sequences: list[ScoringSequence]
) -> float:
    ids = torch.tensor([s.token_ids for s in sequences])
    p = torch.log_softmax(clean(input_ids=ids).logits.double(), -1)
    q = torch.log_softmax(served(input_ids=ids).logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _folded(served: torch.nn.Module, adapter) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    copy_ = copy.deepcopy(served)
    fold_adapter(copy_.state_dict(), adapter)
    return copy_


def test_the_perturbed_layers_are_the_seven_projections_of_each_block(models) -> None:  # type: ignore[no-untyped-def]
    clean, served = models
    names = perturbed_linears(clean, served)
    assert len(names) == 14
    assert "model.layers.1.mlp.down_proj" in names
    assert not any("lm_head" in name or "embed" in name for name in names)
    assert perturbed_linears(clean, clean) == []


def test_the_fit_corrects_held_out_sequences_and_eora_beats_svd(models) -> None:  # type: ignore[no-untyped-def]
    clean, served = models
    before = {k: v.clone() for k, v in served.state_dict().items()}
    fit, held_out = _sequences(12, seed=1), _sequences(6, seed=2)
    eora = fit_compensation_adapter(clean, served, fit, rank=16, method="eora", ridge=1e-2)
    plain = fit_compensation_adapter(clean, served, fit, rank=16, method="svd")
    assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())
    assert sorted(eora.layers) == sorted(perturbed_linears(clean, served))
    assert eora.rank == 16
    kl_none = _mean_kl(clean, served, held_out)
    kl_svd = _mean_kl(clean, _folded(served, plain), held_out)
    kl_eora = _mean_kl(clean, _folded(served, eora), held_out)
    assert kl_eora < kl_svd < kl_none


def test_the_propagated_fit_corrects_held_out_sequences_stage_by_stage(models) -> None:  # type: ignore[no-untyped-def]
    clean, served = models
    before = {k: v.clone() for k, v in served.state_dict().items()}
    fit, held_out = _sequences(12, seed=1), _sequences(6, seed=2)
    adapter = fit_compensation_adapter(clean, served, fit, rank=16, method="propagated", ridge=1.0)
    assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())
    assert sorted(adapter.layers) == sorted(perturbed_linears(clean, served))
    # no autograd graph kept: each one held a layer's float64 work alive (an OOM at 135M)
    assert not any(d.up.requires_grad or d.down.requires_grad for d in adapter.layers.values())
    assert _mean_kl(clean, _folded(served, adapter), held_out) < 0.5 * _mean_kl(
        clean, served, held_out
    )


def test_a_llama_block_runs_its_projections_in_four_stages(models) -> None:  # type: ignore[no-untyped-def]
    _, served = models
    block = served.model.layers[0]
    linears = {
        name: module
        for name, module in block.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    (item,) = _first_block_inputs(served, served.model.layers, _sequences(1, seed=6))
    assert _stages(block, linears, item) == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]


def test_at_full_rank_the_folded_adapter_restores_the_clean_weights(models) -> None:  # type: ignore[no-untyped-def]
    clean, served = models
    adapter = fit_compensation_adapter(
        clean, served, _sequences(4, seed=3), rank=32, method="eora", ridge=1e-3
    )
    restored = _folded(served, adapter)
    names = perturbed_linears(clean, served)
    modules = dict(restored.named_modules())
    clean_modules = dict(clean.named_modules())
    full_rank = [name for name in names if min(modules[name].weight.shape) == 32]
    assert full_rank  # rank 32 covers these layers' whole error
    for name in full_rank:
        assert torch.allclose(modules[name].weight, clean_modules[name].weight, atol=1e-4)


def test_a_pair_without_weight_error_is_refused(models) -> None:  # type: ignore[no-untyped-def]
    clean, _ = models
    with pytest.raises(ValueError, match="no weight error"):
        fit_compensation_adapter(clean, clean, _sequences(2, seed=4), rank=4)


@pytest.mark.parametrize("rank", [0, 33])
def test_a_rank_outside_a_layers_sides_is_refused_naming_the_layer(models, rank: int) -> None:  # type: ignore[no-untyped-def]
    clean, served = models
    message = (
        rf"adapter rank {rank} must be between 1 and 32, the smallest side of the perturbed layer "
        r"model\.layers\.0\.self_attn\.[kv]_proj \(32 × 64\)"
    )
    with pytest.raises(ValueError, match=message):
        adapter_targets(clean, served, rank)
    with pytest.raises(ValueError, match=message):
        fit_compensation_adapter(clean, served, _sequences(1, seed=6), rank=rank, method="svd")


def test_a_rank_equal_to_the_narrowest_side_is_taken(models) -> None:  # type: ignore[no-untyped-def]
    clean, served = models
    assert adapter_targets(clean, served, 32) == perturbed_linears(clean, served)


def test_a_compressed_checkpoint_is_fitted_on_its_dequantized_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """transformers leaves compressed-tensors weights packed until the first forward: the
    plain SVD fit (which runs no forward of its own) must still see the dequantized error."""
    write_compressed_checkpoint(tiny_model_dir, "w8a8", tmp_path / "w8a8")
    clean, _ = load_causal_lm(tiny_model_dir)
    served, _ = load_causal_lm(tmp_path / "w8a8")
    adapter = fit_compensation_adapter(clean, served, _sequences(1, seed=5), rank=4, method="svd")
    name = "model.layers.0.self_attn.q_proj"
    weight = dict(served.named_modules())[name].weight
    assert weight.is_floating_point()
    error = dict(clean.named_modules())[name].weight.double() - weight.double()
    assert error.abs().max() < 0.1 * dict(clean.named_modules())[name].weight.abs().max()
    assert torch.allclose(
        adapter.layers[name].dense().double(), svd_delta(error, 4).dense().double(), atol=1e-5
    )
