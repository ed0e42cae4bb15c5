"""Reading KL curves: the one T (or one inverse scale) that minimises the mean of the records'
interpolated KL curves, shared by the rule fits (`calibration.fitting`) and the calibrated
table's (`calibration.calibrated_table`); the step bucket and request temperatures of records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from noisy_temp_server.calibration.significance import (
    InsufficientDataError,
)
from noisy_temp_server.scoring.records import KLCurveInterpolant, PositionRecords
from noisy_temp_server.temperature.oracle import minimise_convex
from noisy_temp_server.temperature.policy_eval import bucket_index
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = [
    "best_curve_temperature",
    "best_inverse_scale",
    "request_temperatures_of",
    "step_bucket",
]

_CURVE_RTOL = 1e-6
"""Relative tolerance in T of the convex fits on KL curves."""


def step_bucket(step: Tensor, edges: Sequence[int]) -> Tensor:
    """The step bucket of each position of `step` [N] under ascending `edges` from 0."""
    return bucket_index(step, torch.tensor(edges, dtype=torch.int64))


def best_inverse_scale(
    curves: KLCurveInterpolant, scale: Tensor, bounds: TemperatureBounds
) -> tuple[float, float]:
    """(c, mean KL) minimising the mean over rows of KL_i(T_i), T_i = 1 / (c * scale_i).

    T_i is clamped into `bounds` (flat there); c is sought with 1/c in `bounds` and in the
    curves' grid (beyond the grid a curve is flat, so 1/c there gains nothing). Each row's KL
    is convex in u = c * scale_i, so the mean is convex in c up to the interpolation error;
    `minimise_convex` (safeguarded Newton/bisection) solves it to `_CURVE_RTOL` in c.
    """
    log_scale = scale.double().log()
    log_low, log_high = math.log(bounds.t_min), math.log(bounds.t_max)
    log_grid = curves.log_grid

    def evaluate(c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        log_t = -c.log() - log_scale
        inside = (log_t >= log_low) & (log_t <= log_high)
        value, slope, curvature = curves.at(log_t.clamp(log_low, log_high))
        slope, curvature = slope * inside, curvature * inside
        # d log T / dc = -1 / c:  d/dc = -slope / c, d2/dc2 = (curvature + slope) / c^2.
        return (
            value.mean().reshape(1),
            (-slope.mean() / c).reshape(1),
            ((curvature + slope).mean() / c.square()).reshape(1),
        )

    t_high = min(bounds.t_max, math.exp(float(log_grid[-1])))
    t_low = max(bounds.t_min, math.exp(float(log_grid[0])))
    c_low = torch.full((1,), 1.0 / t_high, dtype=torch.float64)
    c_high = torch.full((1,), 1.0 / t_low, dtype=torch.float64)
    c, kl = minimise_convex(evaluate, c_low, c_high, rtol=_CURVE_RTOL)
    return float(c), float(kl)


def best_curve_temperature(
    kl_curves: Tensor, curve_temperatures: Tensor, bounds: TemperatureBounds
) -> float:
    """The one T in `bounds` minimising the mean of the rows' interpolated KL curves.

    kl_curves: [N, G] (N >= 1). Interpolation is linear in the curve values, so this minimises
    the interpolated mean curve, by the convex solve of `best_inverse_scale` (u = 1/T).
    """
    if kl_curves.shape[0] == 0:
        raise InsufficientDataError("no positions to fit a temperature on")
    mean_curve = kl_curves.double().mean(dim=0, keepdim=True)  # [1, G]
    curves = KLCurveInterpolant(mean_curve, curve_temperatures)
    c, _ = best_inverse_scale(curves, torch.ones(1, dtype=torch.float64), bounds)
    return 1.0 / c


def request_temperatures_of(records: PositionRecords) -> tuple[float, ...]:
    """The distinct request temperatures `records` were measured at, ascending (rounded to 6
    decimals, so a float32 0.7 reads 0.7)."""
    return tuple(round(t, 6) for t in torch.unique(records.request_temperature).tolist())
