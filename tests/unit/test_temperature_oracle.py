"""Tests for noisy_temp_server.temperature.oracle: the per-row oracle T, the convex solver
and KL curves."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kl_reference import kl_to_clean

from noisy_temp_server.scoring.records import KL_CURVE_TEMPERATURES
from noisy_temp_server.temperature.oracle import (
    kl_curve,
    minimise_convex,
    oracle_temperature,
)
from noisy_temp_server.temperature.rules import TemperatureBounds

INF = float("inf")
LN3 = math.log(3.0)
BOUNDS = TemperatureBounds(0.25, 4.0)


def noisy_pair(
    seed: int, batch: int = 8, vocab: int = 40, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean rows and served rows that are rescaled (signal shrunk or stretched) plus noise."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn(batch, vocab, generator=generator, dtype=dtype) * 2.5
    gain = 0.6 + torch.rand(batch, 1, generator=generator, dtype=dtype)
    noise = torch.randn(batch, vocab, generator=generator, dtype=dtype)
    return clean, clean * gain + noise * torch.rand(batch, 1, generator=generator, dtype=dtype)


# ---------------------------------------------------------------- per-row oracle, by hand


def test_oracle_undoes_a_pure_rescaling() -> None:
    clean = torch.tensor([[0.0, LN3, 1.0], [0.0, LN3, 1.0], [0.0, LN3, 1.0]])
    # served = clean * 2 -> T* = 2; served = clean / 2 -> T* = 0.5 (below 1); served = clean -> 1
    served = clean * torch.tensor([[2.0], [0.5], [1.0]])
    result = oracle_temperature(clean, served)
    assert result.temperature.tolist() == pytest.approx([2.0, 0.5, 1.0], rel=1e-4)
    assert result.kl.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)


def test_oracle_stops_at_the_bounds() -> None:
    clean = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    served = clean * torch.tensor([[10.0], [0.1]])  # T* = 10 and 0.1, outside [0.5, 2]
    result = oracle_temperature(clean, served, TemperatureBounds(0.5, 2.0))
    assert result.temperature.tolist() == pytest.approx([2.0, 0.5])
    expected_kl = kl_to_clean(clean, served, torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(result.kl, expected_kl)


def test_oracle_with_served_masking_the_clean_support_goes_to_t_max() -> None:
    clean = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 2.0]])
    served = torch.tensor([[0.0, -INF, 1.0], [0.0, 2.0, 4.0]])
    result = oracle_temperature(clean, served)
    assert result.temperature[0].item() == pytest.approx(BOUNDS.t_max)
    assert result.kl[0].item() == INF
    assert result.temperature[1].item() == pytest.approx(2.0, rel=1e-4)


def test_oracle_ignores_tokens_masked_in_both_rows() -> None:
    clean = torch.tensor([[0.0, LN3, -INF]])
    served = torch.tensor([[0.0, 2 * LN3, -INF]])
    assert oracle_temperature(clean, served).temperature.item() == pytest.approx(2.0, rel=1e-4)


# ---------------------------------------------------------------- per-row oracle vs grid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_agrees_with_a_fine_grid_search(seed: int) -> None:
    clean, served = noisy_pair(seed)
    grid = torch.arange(0.25, 4.0 + 1e-9, 1e-4, dtype=torch.float64)
    curves = kl_curve(clean, served, grid)  # [B, G]
    grid_best = grid[curves.argmin(dim=-1)]
    result = oracle_temperature(clean, served, BOUNDS)
    assert torch.all((result.temperature - grid_best).abs() <= 1e-3)
    assert torch.all(result.kl <= curves.min(dim=-1).values + 1e-12)


def test_float32_oracle_is_close_to_float64() -> None:
    clean, served = noisy_pair(3, batch=16, vocab=500)
    exact = oracle_temperature(clean, served).temperature
    single = oracle_temperature(clean.float(), served.float()).temperature
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), exact, rtol=1e-3, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    vocab=st.integers(2, 30),
    others=st.lists(st.floats(0.25, 4.0), min_size=1, max_size=5),
)
def test_oracle_kl_is_no_worse_than_any_other_temperature(
    seed: int, vocab: int, others: list[float]
) -> None:
    clean, served = noisy_pair(seed, batch=3, vocab=vocab)
    result = oracle_temperature(clean, served, BOUNDS)
    assert torch.all((result.temperature >= BOUNDS.t_min) & (result.temperature <= BOUNDS.t_max))
    for other in others:
        assert torch.all(result.kl <= kl_to_clean(clean, served, other) + 1e-10)
    grid = torch.linspace(0.25, 4.0, 376, dtype=torch.float64)
    assert torch.all(result.kl <= kl_curve(clean, served, grid).min(dim=-1).values + 1e-10)


# ---------------------------------------------------------------- the convex solver


def test_minimise_convex_finds_interior_minima_and_stops_at_the_bounds() -> None:
    target = torch.tensor([0.1, 0.5, 3.0, 9.0], dtype=torch.float64)

    def evaluate(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A convex, non-quadratic f with its minimum at `target`: Newton needs several steps.
        d = u - target
        return d.square() + d.pow(4), 2 * d + 4 * d.pow(3), 2 + 12 * d.square()

    low = torch.full((4,), 0.25, dtype=torch.float64)
    high = torch.full((4,), 4.0, dtype=torch.float64)
    u, value = minimise_convex(evaluate, low, high, rtol=1e-9)
    torch.testing.assert_close(u, torch.tensor([0.25, 0.5, 3.0, 4.0], dtype=torch.float64))
    torch.testing.assert_close(value, evaluate(u)[0])


def test_minimise_convex_falls_back_to_bisection_without_curvature() -> None:
    # |u - 2| has no useful second derivative (0): every step must be a bisection.
    def evaluate(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (u - 2).abs(), torch.sign(u - 2), torch.zeros_like(u)

    one = torch.ones(1, dtype=torch.float64)
    u, _ = minimise_convex(evaluate, 0.25 * one, 4.0 * one, rtol=1e-8, max_iterations=80)
    assert float(u) == pytest.approx(2.0, rel=1e-6)


# ---------------------------------------------------------------- KL curves


def test_kl_curve_matches_kl_to_clean() -> None:
    clean, served = noisy_pair(7, dtype=torch.float32)
    grid = torch.tensor([0.3, 0.7, 1.0, 1.5, 2.5])
    curves = kl_curve(clean, served, grid)
    assert curves.shape == (8, 5)
    for column, temperature in enumerate(grid.tolist()):
        torch.testing.assert_close(curves[:, column], kl_to_clean(clean, served, temperature))


@pytest.mark.parametrize(
    "grid", [torch.tensor([1.0, 0.0]), torch.tensor([float("nan")]), torch.ones(2, 2)]
)
def test_kl_curve_rejects_bad_grids(grid: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="temperatures"):
        kl_curve(torch.zeros(1, 3), torch.zeros(1, 3), grid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_curve_on_the_records_grid_matches_the_exact_kl(dtype: torch.dtype) -> None:
    """On the records' grid (whose temperatures pair up by factors of 2, computed by squares and
    square roots of one exp per chain) the curve is the float64 exact KL within float32 rounding:
    1e-5 relative, 2e-6 absolute; with logits wide enough that exp underflows at T = 1/4."""
    generator = torch.Generator().manual_seed(5)
    clean = torch.randn(11, 4000, generator=generator, dtype=torch.float64) * 12
    served = clean + torch.randn(11, 4000, generator=generator, dtype=torch.float64) * 2
    clean[:, 0] = served[:, 0] = -INF
    curves = kl_curve(clean.to(dtype), served.to(dtype), KL_CURVE_TEMPERATURES)
    assert curves.dtype == dtype
    assert curves.shape == (11, len(KL_CURVE_TEMPERATURES))
    for column, temperature in enumerate(KL_CURVE_TEMPERATURES.tolist()):
        torch.testing.assert_close(
            curves[:, column].double(),
            kl_to_clean(clean, served, temperature),
            rtol=1e-5,
            atol=2e-6,
        )
