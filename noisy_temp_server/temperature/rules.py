"""The temperature rules: their names, their bounds, and one small function per closed form.

The functions are vectorised over ``[B]`` tensors (any device) and return float32 (float64 for
float64 input) without bounds applied; :func:`clamp_temperature` applies the bounds. The maths
is in ``docs/reference/``: ``kl-optimal-temperature-derivation.md`` (steps 11 and 12) and
``weight-noise-experiments.md`` (variance matching and the schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

__all__ = [
    "Rule",
    "TemperatureBounds",
    "clamp_temperature",
    "fisher_temperature",
    "linear_temperature",
    "schedule_temperature",
    "sqrt_temperature",
]


class Rule(StrEnum):
    """How the temperature T* of a decode step is chosen (the ``nts_rule`` request key)."""

    OFF = "off"
    """T* = 1: only the request's own temperature."""
    FIXED = "fixed"
    """A constant T*."""
    SQRT = "sqrt"
    """sqrt(1 + alpha(step)): variance matching."""
    LINEAR = "linear"
    """1 + alpha(step): the KL-optimal T when Var_p(z) ~ Var(z)."""
    FISHER = "fisher"
    """1 + sigma2(step) / Var_q(served row): the KL-optimal T with softmax weights."""
    SCHEDULE = "schedule"
    """t_max / sqrt(1 + beta * step)."""
    CALIBRATED = "calibrated"
    """A fitted table over (step bucket, served-entropy bucket); may be below 1."""


@dataclass(frozen=True)
class TemperatureBounds:
    """Closed interval ``[t_min, t_max]`` for T*, with ``0 < t_min <= 1 <= t_max``, both finite.

    Containing 1 keeps "no correction" always reachable. Raises ``ValueError`` otherwise.
    """

    t_min: float = 0.25
    t_max: float = 4.0

    def __post_init__(self) -> None:
        for name in ("t_min", "t_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if not 0 < self.t_min <= 1:
            raise ValueError(f"t_min must satisfy 0 < t_min <= 1, got {self.t_min!r}")
        if self.t_max < 1:
            raise ValueError(f"t_max must satisfy t_max >= 1, got {self.t_max!r}")


def _float_dtype(values: Tensor) -> torch.dtype:
    return torch.float64 if values.dtype == torch.float64 else torch.float32


def _non_negative(values: Tensor) -> Tensor:
    """Cast to a float dtype and clamp negatives to 0 (NaN stays NaN)."""
    return values.to(_float_dtype(values)).clamp(min=0.0)


def sqrt_temperature(alpha: Tensor) -> Tensor:
    """T = sqrt(1 + alpha): variance matching, Var(z~ / T) = Var(z).

    Source: weight-noise-experiments.md ("Key Result"). ``alpha = sigma2 / tau2`` is a variance
    ratio and cannot be negative; a negative value (rounding in a caller's arithmetic) is treated
    as 0. ``alpha = +inf`` gives +inf (bounded later by :func:`clamp_temperature`).
    """
    return _non_negative(alpha).add(1.0).sqrt()


def linear_temperature(alpha: Tensor) -> Tensor:
    """T = 1 + alpha: the KL-optimal T when Var_p(z) is approximated by Var(z).

    Source: kl-optimal-temperature-derivation.md, step 12. Negative alpha is treated as 0.
    """
    return _non_negative(alpha).add(1.0)


def fisher_temperature(sigma2: Tensor, var_p: Tensor, var_p_floor: float) -> Tensor:
    """T = 1 + sigma2 / max(Var_p, var_p_floor): the Fisher-approximation KL-optimal T.

    Source: kl-optimal-temperature-derivation.md, step 11. On a confident row Var_p -> 0 and the
    formula explodes, hence ``var_p_floor`` (> 0, finite; ``ValueError`` otherwise) and the
    bounds. Negative ``sigma2`` is treated as 0. ``sigma2`` and ``var_p`` broadcast together.
    """
    if not (math.isfinite(var_p_floor) and var_p_floor > 0):
        raise ValueError(f"var_p_floor must be finite and > 0, got {var_p_floor!r}")
    noise = _non_negative(sigma2)
    return noise / var_p.to(noise.dtype).clamp(min=var_p_floor) + 1.0


def schedule_temperature(step: Tensor, t_max: float, beta: float) -> Tensor:
    """T(step) = t_max / sqrt(1 + beta * step), for generation steps ``step >= 0``.

    Source: weight-noise-experiments.md, "Key Equations" (temperature schedule). ``t_max`` must
    be finite and > 0 and ``beta`` finite and >= 0 (``ValueError`` otherwise). Returns float32.
    """
    if not (math.isfinite(t_max) and t_max > 0):
        raise ValueError(f"schedule t_max must be finite and > 0, got {t_max!r}")
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"schedule beta must be finite and >= 0, got {beta!r}")
    steps = step.to(torch.float32).clamp(min=0.0)
    return t_max * torch.rsqrt(steps * beta + 1.0)


def clamp_temperature(temperature: Tensor, t_min: Tensor | float, t_max: Tensor | float) -> Tensor:
    """Bound T into ``[t_min, t_max]`` per row; the result is finite and > 0.

    ``t_min``/``t_max`` are floats or ``[B]`` tensors with ``0 < t_min <= 1 <= t_max`` (as in
    :class:`TemperatureBounds`; tensors are not re-checked, to keep this sync-free). ``+inf``
    goes to ``t_max``; NaN (only from NaN statistics, e.g. unvalidated NaN logits) goes to 1,
    the identity, so one bad row never poisons sampling. Returns a new tensor.
    """
    bounded = torch.nan_to_num(temperature, nan=1.0)
    lower = torch.as_tensor(t_min, dtype=bounded.dtype, device=bounded.device)
    upper = torch.as_tensor(t_max, dtype=bounded.dtype, device=bounded.device)
    return torch.clamp(bounded, min=lower, max=upper)
