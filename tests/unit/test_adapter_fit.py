"""The low-rank fits of a layer's error: plain truncated SVD and activation-aware (EoRA)."""

from __future__ import annotations

import pytest
import torch

from noisy_temp_server.adapter.deltas import (
    eora_delta,
    propagated_error,
    svd_delta,
    weighted_error,
)


def _low_rank(out: int, inp: int, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out, rank, generator=generator) @ torch.randn(rank, inp, generator=generator)


def _anisotropic_moment(inp: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(inp, inp, generator=generator, dtype=torch.float64))
    spectrum = torch.logspace(2, -3, inp, dtype=torch.float64)
    return (basis * spectrum) @ basis.T


def test_svd_of_a_hand_checkable_matrix() -> None:
    error = torch.diag(torch.tensor([3.0, 2.0, 0.5]))
    delta = svd_delta(error, 2)
    assert torch.allclose(delta.dense(), torch.diag(torch.tensor([3.0, 2.0, 0.0])), atol=1e-6)


@pytest.mark.parametrize("rank", [2, 3])
def test_both_recover_an_error_of_rank_at_most_r_exactly(rank: int) -> None:
    error = _low_rank(12, 10, 2, seed=1)
    moment = _anisotropic_moment(10, seed=2)
    for delta in (svd_delta(error, rank), eora_delta(error, moment, rank, ridge=1e-3)):
        assert delta.shape == (12, 10)
        assert delta.rank == rank
        assert torch.allclose(delta.dense(), error, atol=1e-4)


def test_eora_beats_svd_on_the_input_weighted_error() -> None:
    error = torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
    moment = _anisotropic_moment(12, seed=4)
    eora = weighted_error(error, eora_delta(error, moment, 3, ridge=1e-6), moment)
    plain = weighted_error(error, svd_delta(error, 3), moment)
    assert eora < 0.5 * plain
    assert plain < weighted_error(error, None, moment)


def test_eora_is_the_best_rank_r_fit_of_the_weighted_error() -> None:
    error = torch.randn(8, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    moment = _anisotropic_moment(6, seed=6)
    best = weighted_error(error, eora_delta(error, moment, 2, ridge=1e-9), moment)
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):  # perturbing the optimum never helps
        delta = eora_delta(error, moment, 2, ridge=1e-9)
        nudged = type(delta)(
            down=delta.down + 1e-2 * torch.randn(delta.down.shape, generator=generator),
            up=delta.up + 1e-2 * torch.randn(delta.up.shape, generator=generator),
        )
        assert weighted_error(error, nudged, moment) >= best * (1 - 1e-6)


def test_a_large_ridge_approaches_the_plain_svd() -> None:
    error = torch.randn(10, 8, generator=torch.Generator().manual_seed(8))
    moment = _anisotropic_moment(8, seed=9)
    plain = svd_delta(error, 3).dense()
    far = eora_delta(error, moment, 3, ridge=1e6).dense()
    near = eora_delta(error, moment, 3, ridge=1e-3).dense()
    assert (far - plain).norm() < 1e-3 * plain.norm()
    assert (near - plain).norm() > 0.1 * plain.norm()


def _paired_inputs(rows: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_c, X_s): clean inputs and served ones that drift from them by a linear map plus
    noise, as a perturbed model's hidden states do."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn(rows, inp, generator=generator, dtype=torch.float64)
    drift = torch.eye(inp, dtype=torch.float64) + 0.2 * torch.randn(
        inp, inp, generator=generator, dtype=torch.float64
    )
    return clean, clean @ drift + 0.05 * torch.randn(
        rows, inp, generator=generator, dtype=torch.float64
    )


def _clean_output_error(
    clean_weight: torch.Tensor,
    served_weight: torch.Tensor,
    delta: torch.Tensor,
    inputs: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """||X_c W_c^T - X_s (W_s + D)^T||^2 / n."""
    clean_x, served_x = inputs
    residual = clean_x @ clean_weight.T - served_x @ (served_weight + delta).T
    return float(residual.pow(2).sum() / len(clean_x))


def test_with_the_same_inputs_the_propagated_error_is_the_weight_error() -> None:
    generator = torch.Generator().manual_seed(10)
    clean_weight = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    served_weight = clean_weight + 0.1 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    moment = _anisotropic_moment(5, seed=11)
    error = propagated_error(clean_weight, served_weight, moment, moment, ridge=0.1)
    assert torch.allclose(error, clean_weight - served_weight, atol=1e-9)


def test_the_propagated_fit_reproduces_the_clean_outputs_better_than_the_weight_error() -> None:
    inputs = _paired_inputs(400, 10, seed=12)
    generator = torch.Generator().manual_seed(13)
    clean_weight = torch.randn(14, 10, generator=generator, dtype=torch.float64)
    served_weight = clean_weight + 0.1 * torch.randn(
        14, 10, generator=generator, dtype=torch.float64
    )
    clean_x, served_x = inputs
    moment, cross = served_x.T @ served_x / 400, served_x.T @ clean_x / 400
    target = propagated_error(clean_weight, served_weight, moment, cross, ridge=1e-6)
    for rank in (3, 10):
        propagated = eora_delta(target, moment, rank, ridge=1e-6).dense().double()
        own = eora_delta(clean_weight - served_weight, moment, rank, ridge=1e-6).dense().double()
        assert _clean_output_error(clean_weight, served_weight, propagated, inputs) < 0.5 * (
            _clean_output_error(clean_weight, served_weight, own, inputs)
        )
    # at full rank and no ridge it is the least-squares map: its residual is orthogonal to X_s
    full = eora_delta(target, moment, 10, ridge=1e-9).dense().double()
    residual = clean_x @ clean_weight.T - served_x @ (served_weight + full).T
    assert (served_x.T @ residual).abs().max() < 1e-4 * (
        served_x.T @ clean_x @ clean_weight.T
    ).abs().max()


def test_refusals() -> None:
    error = torch.ones(4, 3)
    with pytest.raises(ValueError, match="rank 4"):
        svd_delta(error, 4)
    with pytest.raises(ValueError, match="does not match"):
        eora_delta(error, torch.eye(4), 2, ridge=0.1)
    with pytest.raises(ValueError, match="ridge"):
        eora_delta(error, torch.eye(3), 2, ridge=0.0)
    with pytest.raises(ValueError, match="zero"):
        eora_delta(error, torch.zeros(3, 3), 2, ridge=0.1)
    with pytest.raises(ValueError, match="do not match"):
        propagated_error(error, error, torch.eye(3), torch.eye(4), ridge=0.1)
    with pytest.raises(ValueError, match="ridge"):
        propagated_error(error, error, torch.eye(3), torch.eye(3), ridge=-1.0)
