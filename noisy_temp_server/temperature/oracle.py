"""The KL-optimal temperature: per row (the oracle), shared by many rows, and KL on a T grid.

``KL(p || softmax(u * z~))`` is convex in ``u = 1/T`` (second derivative ``Var_{q_u}(z~) >= 0``;
see :class:`~noisy_temp_server.temperature.stats.KLTerms`), and so is any non-negatively
weighted sum of such terms. Each minimisation is a 1-D convex problem on
``[1/t_max, 1/t_min]``, solved by safeguarded Newton on the derivative
``E_{q_u}[z~] - E_p[z~]``: a Newton step when it stays inside the current bracket, bisection
otherwise. Rows are solved together, without a Python loop over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.temperature.rules import TemperatureBounds
from noisy_temp_server.temperature.stats import KLTerms

__all__ = [
    "LogitPairChunk",
    "OracleResult",
    "SharedTemperatureResult",
    "best_shared_temperature",
    "kl_curve",
    "oracle_temperature",
]

LogitPairChunk = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]
"""``(clean [B, V], served [B, V])`` or ``(clean, served, weight [B])`` with weights >= 0."""

# (KL, KL', KL'') at one u per problem, each [R].
_Evaluate = Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class OracleResult:
    """Per-row oracle: ``temperature`` [B] in the bounds, and ``kl`` [B] at that temperature."""

    temperature: Tensor
    kl: Tensor


@dataclass(frozen=True)
class SharedTemperatureResult:
    """The one temperature minimising the weighted sum of KL over many rows.

    Attributes:
        temperature: the minimiser, within the bounds.
        kl_mean: weighted mean KL at ``temperature`` over the rows with finite KL.
        weight_total: sum of the weights of those rows (their count when unweighted).
        rows: number of rows with finite KL (the ones fitted).
        infinite_kl_rows: rows left out because their KL is +inf at every T (the served row
            masks a token the clean row supports).
    """

    temperature: float
    kl_mean: float
    weight_total: float
    rows: int
    infinite_kl_rows: int


def _minimise_convex(
    evaluate: _Evaluate, u_low: Tensor, u_high: Tensor, rtol: float, max_iterations: int
) -> tuple[Tensor, Tensor]:
    """Minimise R independent convex functions of u on ``[u_low, u_high]`` ([R] each).

    Returns ``(u, KL(u))``. A problem whose derivative is >= 0 at ``u_low`` ends there (this
    includes +inf KL everywhere), one whose derivative is <= 0 at ``u_high`` ends there; the
    others iterate until the step or the bracket is below ``rtol * u``.
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
    u, kl = _minimise_convex(terms.kl_with_derivatives, u_low, u_high, rtol, max_iterations)
    return OracleResult(temperature=u.reciprocal(), kl=kl)


def _split_chunk(chunk: LogitPairChunk) -> tuple[Tensor, Tensor, Tensor | None]:
    if len(chunk) == 2:
        return chunk[0], chunk[1], None
    if len(chunk) == 3:
        return chunk[0], chunk[1], chunk[2]
    raise ValueError(
        f"each chunk must be (clean, served) or (clean, served, weight), got {len(chunk)} items"
    )


def best_shared_temperature(
    chunks: Callable[[], Iterable[LogitPairChunk]],
    bounds: TemperatureBounds | None = None,
    *,
    rtol: float = 1e-5,
    max_iterations: int = 50,
) -> SharedTemperatureResult:
    """The single T in ``bounds`` minimising ``sum_rows weight * KL(p || softmax(served / T))``.

    ``chunks`` is called once per pass and must yield the same rows each time, as
    ``(clean [B, V], served [B, V])`` or ``(clean, served, weight [B])`` (weights >= 0, default
    1; chunk sizes may differ). So calibration never holds all logits at once: pass e.g.
    ``lambda: ((c, s) for c, s in bucket_loader())``, or ``lambda: [(clean, served)]`` for
    tensors already in memory. Each pass computes the weighted KL and its first two derivatives
    at one T; expect about 5-10 passes (each re-reads every chunk) plus two at the bounds.

    Rows with +inf KL at every T are left out and counted in the result. Raises ``ValueError``
    if no row with finite KL and positive weight is left, or for a malformed chunk or weight.
    """
    bounds = bounds or TemperatureBounds()
    counts = {"rows": 0, "infinite": 0, "weight": 0.0}

    def evaluate(u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        totals = torch.zeros(3, dtype=torch.float64)
        rows = infinite = 0
        weight_total = 0.0
        for chunk in chunks():
            clean, served, weight = _split_chunk(chunk)
            terms = KLTerms.from_logits(clean, served)
            batch = clean.shape[0]
            dtype = terms.served_shifted.dtype
            row_weight = _chunk_weight(weight, batch, dtype, clean.device)
            finite = torch.isfinite(terms.served_mean_under_clean)
            row_weight = torch.where(finite, row_weight, 0.0)
            u_rows = u.to(dtype=dtype, device=clean.device).expand(batch)
            kl, slope, curvature = terms.kl_with_derivatives(u_rows)
            stacked = torch.where(finite, torch.stack([kl, slope, curvature]), 0.0)
            totals += (stacked * row_weight).sum(dim=-1).to(torch.float64).cpu()
            finite_rows = int(finite.sum())
            rows += finite_rows
            infinite += batch - finite_rows
            weight_total += float(row_weight.sum())
        counts.update(rows=rows, infinite=infinite, weight=weight_total)
        if weight_total <= 0:
            raise ValueError(
                f"no rows to fit: {rows} rows with finite KL and total weight {weight_total} "
                f"({infinite} rows have infinite KL); give at least one row with weight > 0"
            )
        return totals[0:1], totals[1:2], totals[2:3]

    one = torch.ones(1, dtype=torch.float64)
    u_low, u_high = _inverse_bounds(bounds, one)
    u, kl_sum = _minimise_convex(evaluate, u_low, u_high, rtol, max_iterations)
    weight_total = float(counts["weight"])
    return SharedTemperatureResult(
        temperature=float(u.reciprocal()),
        kl_mean=float(kl_sum) / weight_total,
        weight_total=weight_total,
        rows=int(counts["rows"]),
        infinite_kl_rows=int(counts["infinite"]),
    )


def _chunk_weight(
    weight: Tensor | None, batch: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    if weight is None:
        return torch.ones(batch, dtype=dtype, device=device)
    if weight.shape != (batch,):
        raise ValueError(f"weight must have shape [{batch}], got {tuple(weight.shape)}")
    weight = weight.to(dtype=dtype, device=device)
    if not bool(((weight >= 0) & torch.isfinite(weight)).all()):
        raise ValueError("weights must be finite and >= 0")
    return weight


def kl_curve(
    clean: Tensor, served: Tensor, temperatures: Tensor, *, max_elements: int = 1 << 24
) -> Tensor:
    """``[B, G]`` KL(p || softmax(served / T_g)) at each grid temperature ``temperatures [G]``.

    Temperatures must be finite and > 0 (``ValueError`` otherwise). The grid is processed in
    column blocks so that the ``[B, block, V]`` temporary stays near ``max_elements`` elements
    (at least one column: ``B * V``). Returns the compute dtype (float32 unless float64 input).
    """
    if temperatures.dim() != 1 or temperatures.numel() == 0:
        raise ValueError(f"temperatures must be a non-empty [G] tensor, got {temperatures.shape}")
    if not bool(((temperatures > 0) & torch.isfinite(temperatures)).all()):
        raise ValueError("temperatures must be finite and > 0")
    terms = KLTerms.from_logits(clean, served)
    batch, vocab = terms.served_shifted.shape
    inverse = temperatures.to(dtype=terms.served_shifted.dtype, device=clean.device).reciprocal()
    block = max(1, max_elements // max(1, batch * vocab))
    columns = [terms.kl(part.unsqueeze(0)) for part in inverse.split(block)]
    return torch.cat(columns, dim=-1)
