"""Tests for noisy_temp_server.temperature.rules: the closed forms and the bounds."""

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noisy_temp_server.temperature.rules import (
    Rule,
    TemperatureBounds,
    clamp_temperature,
    fisher_temperature,
    linear_temperature,
    schedule_temperature,
    sqrt_temperature,
)
from noisy_temp_server.temperature.stats import pair_statistics

INF = float("inf")


def test_rule_names_are_the_request_keys() -> None:
    assert [rule.value for rule in Rule] == [
        "off",
        "fixed",
        "sqrt",
        "linear",
        "fisher",
        "schedule",
        "calibrated",
    ]
    assert Rule("fisher") is Rule.FISHER


def test_closed_forms_by_hand() -> None:
    alpha = torch.tensor([0.0, 0.44, 3.0])
    # sqrt(1 + 0.44) = 1.2, sqrt(4) = 2
    assert sqrt_temperature(alpha).tolist() == pytest.approx([1.0, 1.2, 2.0])
    assert linear_temperature(alpha).tolist() == pytest.approx([1.0, 1.44, 4.0])
    # 1 + 0.5 / max(0.25, 0.1) = 3;  1 + 0.5 / max(0.01, 0.1) = 6 (floored)
    fisher = fisher_temperature(torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.01]), 0.1)
    assert fisher.tolist() == pytest.approx([3.0, 6.0])
    # 2 / sqrt(1 + 0.5 * 6) = 2 / 2 = 1;  step 0 -> t_max
    schedule = schedule_temperature(torch.tensor([0, 6]), t_max=2.0, beta=0.5)
    assert schedule.dtype == torch.float32
    assert schedule.tolist() == pytest.approx([2.0, 1.0])


def test_negative_alpha_and_sigma2_are_treated_as_zero() -> None:
    negative = torch.tensor([-0.5])
    assert sqrt_temperature(negative).item() == 1.0
    assert linear_temperature(negative).item() == 1.0
    assert fisher_temperature(negative, torch.tensor([1.0]), 0.1).item() == 1.0


def test_infinite_alpha_saturates_at_the_upper_bound() -> None:
    t = linear_temperature(torch.tensor([INF]))
    assert clamp_temperature(t, 0.25, 4.0).item() == 4.0


def test_clamp_temperature_per_row_bounds() -> None:
    t = torch.tensor([0.1, 1.5, 9.0, INF, float("nan"), 3.0])
    t_min = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 1.0])
    t_max = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 1.0])
    # NaN goes to 1, the identity; +inf to t_max
    assert clamp_temperature(t, t_min, t_max).tolist() == [0.5, 1.5, 2.0, 2.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fisher_temperature(torch.ones(1), torch.ones(1), 0.0), "var_p_floor"),
        (lambda: fisher_temperature(torch.ones(1), torch.ones(1), INF), "var_p_floor"),
        (lambda: schedule_temperature(torch.ones(1), 0.0, 0.1), "t_max"),
        (lambda: schedule_temperature(torch.ones(1), 2.0, -0.1), "beta"),
    ],
)
def test_bad_rule_parameters_raise(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("t_min", "t_max", "message"),
    [
        (0.0, 4.0, "0 < t_min <= 1"),
        (1.5, 4.0, "0 < t_min <= 1"),
        (0.5, 0.9, "t_max >= 1"),
        (0.5, INF, "finite"),
        (float("nan"), 2.0, "finite"),
        (True, 2.0, "number"),
        ("0.5", 2.0, "number"),
    ],
)
def test_bounds_validation(t_min: float, t_max: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TemperatureBounds(t_min, t_max)


def test_default_bounds() -> None:
    assert TemperatureBounds() == TemperatureBounds(0.25, 4.0)
    assert TemperatureBounds(1, 1).t_max == 1


# ---------------------------------------------------------------- properties

alphas = st.floats(0.0, 1e6)


@settings(max_examples=100, deadline=None)
@given(alpha=alphas)
def test_sqrt_never_exceeds_linear_and_both_are_at_least_one(alpha: float) -> None:
    a = torch.tensor([alpha], dtype=torch.float64)
    assert 1.0 <= sqrt_temperature(a).item() <= linear_temperature(a).item()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**20), noise=st.floats(0.0, 3.0))
def test_linear_equals_fisher_when_var_p_equals_tau2(seed: int, noise: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn(3, 10, generator=generator, dtype=torch.float64)
    served = clean + noise * torch.randn(3, 10, generator=generator, dtype=torch.float64)
    stats = pair_statistics(clean, served)
    fisher = fisher_temperature(stats.sigma2, stats.tau2, var_p_floor=1e-12)
    torch.testing.assert_close(fisher, linear_temperature(stats.alpha))


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=8
    ),
    t_min=st.floats(0.01, 1.0),
    t_max=st.floats(1.0, 100.0),
)
def test_clamped_temperature_is_always_in_bounds(
    values: list[float], t_min: float, t_max: float
) -> None:
    t = clamp_temperature(torch.tensor(values), t_min, t_max)
    assert torch.all(torch.isfinite(t))
    assert torch.all((t >= torch.tensor(t_min)) & (t <= torch.tensor(t_max)))


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
    t_max=st.floats(0.1, 10.0),
    beta=st.floats(0.0, 10.0),
)
def test_schedule_decreases_from_t_max(steps: list[int], t_max: float, beta: float) -> None:
    ordered = torch.tensor(sorted(steps))
    t = schedule_temperature(ordered, t_max, beta)
    assert torch.all(t <= t_max * (1 + 1e-6))
    assert torch.all(t > 0)
    assert torch.all(t[1:] <= t[:-1])
    assert schedule_temperature(torch.tensor([0]), t_max, beta).item() == pytest.approx(t_max)


def test_float64_alpha_stays_float64() -> None:
    a = torch.tensor([0.5], dtype=torch.float64)
    assert linear_temperature(a).dtype == torch.float64
    assert math.isclose(sqrt_temperature(a).item(), math.sqrt(1.5))
