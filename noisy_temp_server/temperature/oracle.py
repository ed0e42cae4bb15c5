"""The KL-optimal temperature per row (the oracle), the convex solver behind it, KL on a T grid.

``KL(p || softmax(u * z~))`` is convex in ``u = 1/T`` (second derivative ``Var_{q_u}(z~) >= 0``;
see :class:`~noisy_temp_server.temperature.stats.KLTerms`), and so is any non-negatively
weighted sum of such terms. Each minimisation is a 1-D convex problem on
``[1/t_max, 1/t_min]``, solved by safeguarded Newton on the derivative
``E_{q_u}[z~] - E_p[z~]``: a Newton step when it stays inside the current bracket, bisection
otherwise (`minimise_convex`, also used to fit one T to many rows' stored KL curves in
`noisy_temp_server.calibration.fitting`). Rows are solved together, without a Python loop over
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
    "kl_curve_of_terms",
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


def inverse_bounds(bounds: TemperatureBounds, like: Tensor) -> tuple[Tensor, Tensor]:
    """(1 / t_max, 1 / t_min), each shaped like `like`: the bounds of u = 1/T."""
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
    u_low, u_high = inverse_bounds(bounds, terms.neg_entropy_clean)
    u, kl = minimise_convex(terms.kl_with_derivatives, u_low, u_high, rtol, max_iterations)
    return OracleResult(temperature=u.reciprocal(), kl=kl)


_CURVE_ROW_BLOCK = 8
"""Rows of the KL curve computed together: two [8, V] float32 buffers (3 MiB at V = 49 152)
stay in a core's L2 cache while a row block goes through every grid column."""


def kl_curve(clean: Tensor, served: Tensor, temperatures: Tensor) -> Tensor:
    """``[B, G]`` KL(p || softmax(served / T_g)) at each grid temperature ``temperatures [G]``:
    :func:`kl_curve_of_terms` of ``KLTerms.from_logits(clean, served)`` (validated as there)."""
    return kl_curve_of_terms(KLTerms.from_logits(clean, served), temperatures)


def kl_curve_of_terms(terms: KLTerms, temperatures: Tensor) -> Tensor:
    """``[B, G]`` KL(p || softmax(u_g * s)) of the pair's :class:`KLTerms` at ``u_g = 1 / T_g``
    for each grid temperature of ``temperatures [G]``.

    Temperatures must be finite and > 0 (``ValueError`` otherwise). The cost is the sums
    ``sum(exp(u_g * s))`` of the max-shifted served row ``s <= 0`` (its top entry is exactly 0, so
    each sum is >= 1: no further shift is needed), see :func:`_exp_sums`. Returns the compute
    dtype (float32 unless float64 input); equal to :meth:`KLTerms.kl` up to rounding (float32:
    within about 1e-6 relative, 1e-6 absolute).
    """
    if temperatures.dim() != 1 or temperatures.numel() == 0:
        raise ValueError(f"temperatures must be a non-empty [G] tensor, got {temperatures.shape}")
    if not bool(((temperatures > 0) & torch.isfinite(temperatures)).all()):
        raise ValueError("temperatures must be finite and > 0")
    shifted = terms.served_shifted
    inverse = temperatures.to(dtype=shifted.dtype, device=shifted.device).reciprocal()
    kl = (
        terms.neg_entropy_clean.unsqueeze(-1)
        - inverse * terms.served_mean_under_clean.unsqueeze(-1)
        + _exp_sums(shifted, inverse.tolist()).log_()
    )
    return kl.clamp(min=0.0)


def _doubling_chains(inverse: list[float]) -> list[list[int]]:
    """The columns of ``inverse`` (u values) grouped into chains u, 2u, 4u, ... (ascending; each
    ratio exactly 2 in floating point), every column in exactly one chain."""
    chains: list[list[int]] = []
    for column in sorted(range(len(inverse)), key=inverse.__getitem__):
        chain = next((c for c in chains if inverse[c[-1]] * 2 == inverse[column]), None)
        if chain is None:
            chains.append([column])
        else:
            chain.append(column)
    return chains


def _exp_sums(shifted: Tensor, inverse: list[float]) -> Tensor:
    """``[B, G]`` row sums of ``exp(u_g * shifted)`` for ``shifted [B, V] <= 0``.

    Columns whose u differ by factors of 2 (`_doubling_chains`; on ``KL_CURVE_TEMPERATURES`` 8
    chains of 33 columns) cost one exp, at the chain's middle column; the others follow from
    ``exp(2us) = exp(us)^2`` and ``exp(us/2) = sqrt(exp(us))``: a square doubles an element's
    relative rounding error, a square root halves it, and an element whose exp underflowed
    (``us < -87``) stays 0 under the square root where the exact value is below 1e-19, adding
    less than ``V * 1e-19`` to a sum that is >= 1. Rows go `_CURVE_ROW_BLOCK` at a time so that
    the two buffers stay in cache across the grid.
    """
    chains = _doubling_chains(inverse)
    rows = shifted.shape[0]
    sums = shifted.new_empty(rows, len(inverse))
    centre = shifted.new_empty(min(rows, _CURVE_ROW_BLOCK), shifted.shape[1])
    walker = torch.empty_like(centre)
    for first in range(0, rows, _CURVE_ROW_BLOCK):
        block = shifted[first : first + _CURVE_ROW_BLOCK]
        out = sums[first : first + _CURVE_ROW_BLOCK]
        here, other = centre[: block.shape[0]], walker[: block.shape[0]]
        for chain in chains:
            middle = len(chain) // 2
            torch.mul(block, inverse[chain[middle]], out=here).exp_()
            torch.sum(here, dim=-1, out=out[:, chain[middle]])
            other.copy_(here)
            for column in chain[middle + 1 :]:  # u doubles: square
                torch.sum(other.square_(), dim=-1, out=out[:, column])
            for column in reversed(chain[:middle]):  # u halves: square root
                torch.sum(here.sqrt_(), dim=-1, out=out[:, column])
    return sums
