"""The KL-optimal temperature per row (the oracle), the convex solver behind it, KL on a T grid.

``KL(p || softmax(u * z~))`` is convex in ``u = 1/T`` (second derivative ``Var_{q_u}(z~) >= 0``;
see :class:`~noisy_temp_server.temperature.stats.KLTerms`), and so is any non-negatively
weighted sum of such terms. Each minimisation is a 1-D convex problem on
``[1/t_max, 1/t_min]``, solved by safeguarded Newton on the derivative
``E_{q_u}[z~] - E_p[z~]``: a Newton step when it stays inside the current bracket, bisection
otherwise (`minimise_convex`, also used to fit one T to many rows' stored KL curves in
`noisy_temp_server.estimation.fitting`). Rows are solved together, without a Python loop over
rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.temperature.rules import TemperatureBounds
from noisy_temp_server.temperature.stats import KLTerms

__all__ = [
    "ConvexObjective",
    "OracleResult",
    "kl_curve",
    "minimise_convex",
    "oracle_temperature",
]

ConvexObjective = Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]
"""``u [R] -> (f, f', f'')`` at one u per problem, each ``[R]``."""


@dataclass(frozen=True)
class OracleResult:
    """Per-row oracle: ``temperature`` [B] in the bounds, and ``kl`` [B] at that temperature."""

    temperature: Tensor
    kl: Tensor


def minimise_convex(
    evaluate: ConvexObjective,
    u_low: Tensor,
    u_high: Tensor,
    rtol: float = 1e-5,
    max_iterations: int = 50,
) -> tuple[Tensor, Tensor]:
    """Minimise R independent convex functions of u on ``[u_low, u_high]`` ([R] each).

    Safeguarded Newton from u = 1 (clamped into the interval): a Newton step when it stays
    inside the bracket that the sign of the derivative keeps, bisection otherwise. Returns
    ``(u, f(u))``. A problem whose derivative is >= 0 at ``u_low`` ends there (this includes
    +inf KL everywhere), one whose derivative is <= 0 at ``u_high`` ends there; the others
    iterate until the step or the bracket is below ``rtol * u``. For a function that is not
    exactly convex it still ends where the derivative changes sign from - to + inside the
    bracket (a local minimum).
    """
    kl_low, slope_low, _ = evaluate(u_low)
    kl_high, slope_high, _ = evaluate(u_high)
    at_low = ~(slope_low < 0)
    at_high = ~at_low & ~(slope_high > 0)
    interior = ~(at_low | at_high)

    low, high = u_low.clone(), u_high.clone()
    u = torch.ones_like(u_low).clamp(min=u_low, max=u_high)  # start at T = 1
    kl = kl_low
    if bool(interior.any()):
        for iteration in range(max_iterations):
            kl, slope, curvature = evaluate(u)
            descending = slope < 0
            low = torch.where(descending, u, low)
            high = torch.where(descending, high, u)
            newton = u - slope / curvature
            inside = (newton >= low) & (newton <= high)  # False for NaN / inf steps
            proposal = torch.where(inside, newton, 0.5 * (low + high))
            tolerance = rtol * u
            converged = ((proposal - u).abs() <= tolerance) | ((high - low) <= tolerance)
            if iteration == max_iterations - 1 or bool((converged | ~interior).all()):
                break
            u = torch.where(interior, proposal, u)
    u = torch.where(at_low, u_low, torch.where(at_high, u_high, u))
    kl = torch.where(at_low, kl_low, torch.where(at_high, kl_high, kl))
    return u, kl


def _inverse_bounds(bounds: TemperatureBounds, like: Tensor) -> tuple[Tensor, Tensor]:
    low = torch.full_like(like, 1.0 / bounds.t_max)
    high = torch.full_like(like, 1.0 / bounds.t_min)
    return low, high


def oracle_temperature(
    clean: Tensor,
    served: Tensor,
    bounds: TemperatureBounds | None = None,
    *,
    rtol: float = 1e-5,
    max_iterations: int = 50,
) -> OracleResult:
    """Per row, the T in ``bounds`` minimising KL(p || softmax(served / T)).

    ``clean``/``served``: ``[B, V]`` logits (validated as in
    :func:`~noisy_temp_server.temperature.stats.check_logits`); ``bounds`` defaults to
    ``TemperatureBounds()``. Converges to ``rtol`` relative in T (a few Newton steps; bisection
    guarantees it within ``max_iterations``). Rows whose KL is +inf at every T get ``t_max``
    and ``kl = inf``. Memory: about three ``[B, V]`` tensors in the compute dtype.
    """
    bounds = bounds or TemperatureBounds()
    terms = KLTerms.from_logits(clean, served)
    u_low, u_high = _inverse_bounds(bounds, terms.neg_entropy_clean)
    u, kl = minimise_convex(terms.kl_with_derivatives, u_low, u_high, rtol, max_iterations)
    return OracleResult(temperature=u.reciprocal(), kl=kl)


def kl_curve(clean: Tensor, served: Tensor, temperatures: Tensor) -> Tensor:
    """``[B, G]`` KL(p || softmax(served / T_g)) at each grid temperature ``temperatures [G]``.

    Temperatures must be finite and > 0 (``ValueError`` otherwise). One grid column at a time
    through one ``[B, V]`` buffer: ``sum(exp(u * s))`` of the max-shifted served row ``s <= 0``
    (its top entry is exactly 0, so the sum is >= 1 and cannot overflow; no further shift is
    needed), i.e. one multiply and one exp per element and column. Returns the compute dtype
    (float32 unless float64 input); equal to :meth:`KLTerms.kl` up to rounding.
    """
    if temperatures.dim() != 1 or temperatures.numel() == 0:
        raise ValueError(f"temperatures must be a non-empty [G] tensor, got {temperatures.shape}")
    if not bool(((temperatures > 0) & torch.isfinite(temperatures)).all()):
        raise ValueError("temperatures must be finite and > 0")
    terms = KLTerms.from_logits(clean, served)
    shifted = terms.served_shifted
    inverse = temperatures.to(dtype=shifted.dtype, device=shifted.device).reciprocal()
    buffer = torch.empty_like(shifted)
    sums = torch.empty(
        shifted.shape[0], inverse.shape[0], dtype=shifted.dtype, device=shifted.device
    )
    for column, u in enumerate(inverse.tolist()):
        torch.mul(shifted, u, out=buffer)
        torch.sum(buffer.exp_(), dim=-1, out=sums[:, column])
    kl = (
        terms.neg_entropy_clean.unsqueeze(-1)
        - inverse * terms.served_mean_under_clean.unsqueeze(-1)
        + sums.log_()
    )
    return kl.clamp(min=0.0)
