"""A per-token logit bias fitted jointly with one temperature: q = softmax((z~ + b) / T).

A temperature can only stretch or flatten the served row; quantisation and a fixed weight-noise
draw also push particular tokens' logits the same way at every position. A bias vector b (one
number per vocabulary token) learns that systematic part from paired clean/served rows.

With u = 1/T and c = u * b the served distribution is softmax(u * z~ + c), and per row i

    KL_i(u, c) = E_p[log p] - u * E_p[s_i] - p_i . c + logsumexp(u * s_i + c)

(s_i = z~_i - max z~_i), which is jointly convex in (u, c): affine terms plus a log-sum-exp of
an affine function. The fit minimises

    F(u, c) = mean_i KL_i(u, c) + (penalty / 2) * |c|^2

with the analytic gradient dF/dc = mean_i q_i - mean_i p_i + penalty * c and
dF/du = mean_i (E_{q_i}[s_i] - E_p[s_i]), by L-BFGS with a strong-Wolfe line search (a convex,
smooth problem: it converges to the minimiser; the penalty makes it unique, with sum(c) = 0).
The penalty is chosen on validation rows (`fit_logit_bias`) over a descending path with warm
starts, and "no bias, T only" competes too, so the chosen fit is never worse on the validation
rows than the best single temperature.

**The output head's span.** When the served model runs the clean model's output head W [V, d]
(weights perturbed or quantised before it, runtime noise aside), both z = W h and z~ = W h~, so
the drift z - z~ = W (h - h~) lies in W's d-dimensional column span. `fit_logit_bias` with a
`basis` (W) therefore first fits c = W g with an L2 penalty on g (d numbers instead of V: far
less data to fit them), then a free per-token residual on top,
c = W g + r, each penalty chosen on validation. Still convex (c is linear in (g, r)), and what
is served is the same one vector b = c / u.

The rows, the correction and its KL on them are `correction.paired_rows`'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from noisy_temp_server.correction.paired_rows import (
    LogitBias,
    PairedRows,
    evaluate_bias,
    kl_objective,
)
from noisy_temp_server.temperature.rules import TemperatureBounds
from noisy_temp_server.temperature.stats import row_dot

__all__ = [
    "DEFAULT_PENALTIES",
    "BiasFit",
    "BiasPath",
    "diagonal_curvature",
    "fit_bias_at_penalty",
    "fit_logit_bias",
]

DEFAULT_PENALTIES: tuple[float, ...] = tuple(10.0 ** (-k / 2) for k in range(2, 15))
"""The penalty path, descending: 1e-1, 3.2e-2, ..., 1e-7."""


@dataclass(frozen=True)
class BiasFit:
    """One fit: the correction; the penalty of its free per-token part (inf: none) and of its
    head-span part (inf: none; both inf: T only); the head-span coefficients in bias units,
    float64 [d] (`correction.bias` = basis @ head + free part, centred; None without a head
    part); the objective's mean KL on the fit rows; L-BFGS's function evaluations."""

    correction: LogitBias
    penalty: float
    fit_kl: float
    evaluations: int
    head_penalty: float = math.inf
    head: Tensor | None = None

    @property
    def has_bias(self) -> bool:
        """Whether any bias was fitted (not the T-only fit)."""
        return math.isfinite(self.penalty) or math.isfinite(self.head_penalty)


@dataclass(frozen=True)
class _Layout:
    """How the optimiser's vector x = (u, g, r) maps to (u, c = basis @ g + r) and back: g has
    d entries with a basis (else none), r has V; `free` marks the entries being fitted."""

    basis: Tensor | None  # float64 [V, d]
    penalty: float  # on r (0 when r is not fitted)
    head_penalty: float  # on g (0 when g is not fitted)
    free: Tensor  # float64 [1 + d + V] of 0/1

    @property
    def head_size(self) -> int:
        return 0 if self.basis is None else int(self.basis.shape[1])

    def split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(u, g, r) views of x."""
        d = self.head_size
        return x[0], x[1 : 1 + d], x[1 + d :]

    def logit_shift(self, x: Tensor) -> Tensor:
        """c = basis @ g + r, float64 [V]."""
        _, g, r = self.split(x)
        return r if self.basis is None else self.basis @ g + r

    def value_and_grad(self, rows: PairedRows, x: Tensor) -> tuple[Tensor, Tensor]:
        """The penalised objective and its gradient in x (zero where x is not free)."""
        u, g, r = self.split(x)
        value, grad_u, grad_c = kl_objective(rows, u, self.logit_shift(x))
        value = value + 0.5 * (self.penalty * torch.dot(r, r) + self.head_penalty * torch.dot(g, g))
        parts = [grad_u.reshape(1)]
        if self.basis is not None:
            parts.append(self.basis.T @ grad_c + self.head_penalty * g)
        parts.append(grad_c + self.penalty * r)
        return value, torch.cat(parts) * self.free

    def scale(self, rows: PairedRows) -> Tensor:
        """The square root of the penalised Hessian's diagonal at q = p (`diagonal_curvature`,
        through the basis for g; floored at 1e-12), so that u, g and r are equally well
        resolved by L-BFGS."""
        curvature = diagonal_curvature(rows)
        p_mean = curvature[1:]
        parts = [curvature[:1]]
        if self.basis is not None:
            parts.append(self.basis.square().T @ p_mean + self.head_penalty)
        parts.append(p_mean + self.penalty)
        return torch.cat(parts).clamp(min=1e-12).sqrt()


def fit_bias_at_penalty(
    rows: PairedRows,
    penalty: float,
    *,
    basis: Tensor | None = None,
    head_penalty: float = math.inf,
    bounds: TemperatureBounds | None = None,
    start: BiasFit | None = None,
    fit_bias: bool = True,
    fit_temperature: bool = True,
    max_evaluations: int = 200,
) -> BiasFit:
    """Minimise the penalised objective over (T, b) from `start` (default: b = 0, T = 1).

    b = basis @ g + r: with a `basis` [V, d] (the output head's weights) and a finite
    `head_penalty` the head-span part g is fitted with that L2 penalty (on g / T), else it
    stays at `start`'s (none without a basis or when `start` has none: `head` is then None);
    the free per-token part r is fitted with `penalty` (on r / T) unless `fit_bias=False`,
    which keeps it at `start`'s. `fit_temperature=False` keeps T at `start`'s. T ends in
    `bounds` (default `TemperatureBounds()`): if the free optimum lies outside, T is clamped
    to the nearer bound and b refitted there. Penalties of fitted parts must be > 0.
    """
    if not len(rows):
        raise ValueError("cannot fit a bias on zero rows")
    fit_head = basis is not None and math.isfinite(head_penalty)
    if (fit_bias and not penalty > 0) or (fit_head and not head_penalty > 0):
        raise ValueError(
            f"the penalty must be > 0 to fit a bias part, got penalty={penalty}, "
            f"head_penalty={head_penalty}"
        )
    if basis is not None and basis.shape[0] != rows.vocab_size:
        raise ValueError(f"the basis has {basis.shape[0]} rows, the rows {rows.vocab_size} tokens")
    bounds = bounds or TemperatureBounds()
    device = rows.served_shifted.device
    keeps_head = fit_head or (start is not None and start.head is not None)
    basis64 = None if basis is None or not keeps_head else basis.to(device, torch.float64)
    d = 0 if basis64 is None else basis64.shape[1]
    free = torch.cat(
        [
            torch.full((1,), float(fit_temperature), dtype=torch.float64, device=device),
            torch.full((d,), float(fit_head), dtype=torch.float64, device=device),
            torch.full((rows.vocab_size,), float(fit_bias), dtype=torch.float64, device=device),
        ]
    )
    layout = _Layout(basis64, penalty if fit_bias else 0.0, head_penalty if fit_head else 0.0, free)
    x0 = _start_point(start, basis64, rows.vocab_size, device)
    x, evaluations = _optimise(rows, layout, x0, max_evaluations)
    penalties = (penalty if fit_bias else math.inf, head_penalty if fit_head else math.inf)
    result = _as_fit(layout, x, *penalties, evaluations)
    u = float(x[0])
    u_bounded = min(max(u, 1.0 / bounds.t_max), 1.0 / bounds.t_min)
    if fit_temperature and u_bounded != u:
        clamped = replace(result, correction=LogitBias(result.correction.bias, 1.0 / u_bounded))
        refit = fit_bias_at_penalty(
            rows,
            penalty,
            basis=basis,
            head_penalty=head_penalty,
            bounds=bounds,
            start=clamped,
            fit_bias=fit_bias,
            fit_temperature=False,
            max_evaluations=max_evaluations,
        )
        return replace(refit, evaluations=result.evaluations + refit.evaluations)
    with torch.no_grad():
        kl = float(kl_objective(rows, x[0], layout.logit_shift(x))[0])
    return replace(result, fit_kl=kl)


def _start_point(
    start: BiasFit | None, basis: Tensor | None, vocab_size: int, device: torch.device
) -> Tensor:
    """x = (u, g, r) of `start` (b = 0, T = 1 without one): r is what the head part leaves."""
    d = 0 if basis is None else basis.shape[1]
    if start is None:
        x = torch.zeros(1 + d + vocab_size, dtype=torch.float64, device=device)
        x[0] = 1.0
        return x
    u = 1.0 / start.correction.temperature
    bias = start.correction.bias.to(device, torch.float64)
    head = torch.zeros(d, dtype=torch.float64, device=device)
    if basis is not None and start.head is not None:
        head = start.head.to(device, torch.float64)
        shift = basis @ head
        bias = bias - (shift - shift.mean())
    u_tensor = torch.tensor([u], dtype=torch.float64, device=device)
    return torch.cat([u_tensor, head * u, bias * u])


def _optimise(
    rows: PairedRows, layout: _Layout, x0: Tensor, max_evaluations: int
) -> tuple[Tensor, int]:
    """L-BFGS (strong-Wolfe line search) on y = x * scale from x0 (a convex, smooth problem: it
    converges to the minimiser); returns x and the function evaluations."""
    scale = layout.scale(rows)
    y = (x0 * scale).requires_grad_()
    optimizer = torch.optim.LBFGS(
        [y],
        max_iter=max_evaluations,
        max_eval=max_evaluations,
        tolerance_grad=1e-10,
        tolerance_change=1e-11,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    evaluations = 0

    def closure() -> Tensor:
        nonlocal evaluations
        evaluations += 1
        with torch.no_grad():
            value, grad = layout.value_and_grad(rows, y / scale)
            y.grad = grad / scale
        return value

    optimizer.step(closure)
    return (y / scale).detach(), evaluations


def _as_fit(
    layout: _Layout, x: Tensor, penalty: float, head_penalty: float, evaluations: int
) -> BiasFit:
    """The `BiasFit` of x (fit_kl left as nan for the caller): b = c / u, centred."""
    u, g, _ = layout.split(x)
    bias = (layout.logit_shift(x) / u).to(torch.float32)
    head = None if layout.basis is None else g / u
    correction = LogitBias(bias=bias - bias.mean(), temperature=1.0 / float(u))
    return BiasFit(correction, penalty, math.nan, evaluations, head_penalty, head)


def diagonal_curvature(rows: PairedRows) -> Tensor:
    """float64 [V + 1]: the unpenalised objective's Hessian diagonal in (u, c) at q = p:
    (mean Var_p(s), mean p)."""
    second_moment = torch.zeros((), dtype=torch.float64, device=rows.served_shifted.device)
    for chunk in rows.chunks():
        served = rows.served_shifted[chunk]
        moment = row_dot(rows.clean_prob[chunk], served.square())
        second_moment += moment.double().sum()
    var_u = second_moment / len(rows) - rows.served_mean.square().mean()
    p_mean = rows.clean_prob.sum(dim=0, dtype=torch.float64) / len(rows)
    return torch.cat([var_u.reshape(1), p_mean])


def _validation_kl(rows: PairedRows, correction: LogitBias) -> float:
    return float(evaluate_bias(rows, correction).kl.mean())


@dataclass(frozen=True)
class BiasPath:
    """`fit_logit_bias`'s result: the chosen fit; the validation mean KL of every free-part
    penalty tried (inf: T only) and of every head-span penalty tried, in the order tried."""

    chosen: BiasFit
    validation_kl: dict[float, float]
    head_validation_kl: dict[float, float] = field(default_factory=dict)

    @property
    def refine_penalty(self) -> float | None:
        """The free per-token penalty a refinement of the chosen fit should use (the online
        fit): the chosen one, else the free-part penalty best on validation; None when the
        T-only fit was chosen."""
        if not self.chosen.has_bias:
            return None
        if math.isfinite(self.chosen.penalty):
            return self.chosen.penalty
        tried = {p: kl for p, kl in self.validation_kl.items() if math.isfinite(p)}
        return min(tried, key=tried.__getitem__) if tried else None


def fit_logit_bias(
    train: PairedRows,
    validation: PairedRows,
    *,
    basis: Tensor | None = None,
    penalties: Sequence[float] = DEFAULT_PENALTIES,
    bounds: TemperatureBounds | None = None,
    patience: int = 2,
) -> BiasPath:
    """Fit (b, T) on `train` along descending penalty paths (each fit warm-started from the
    previous) and keep the fit with the lowest mean KL on `validation`; a T-only fit (no bias)
    competes too and wins ties, so the result is never worse on `validation` than the best
    single temperature. With a `basis` (the output head's weights, [V, d]) the head-span part
    is fitted first, alone, along `penalties`; then the free per-token part on top of the best
    head-span fit (its penalty kept, g refitted), along `penalties` again. A path stops once
    `patience` penalties in a row were worse on validation than the best so far (the
    validation KL is convex-shaped along a path).
    """
    ordered = sorted(penalties, reverse=True)
    if not ordered or ordered[-1] <= 0:
        raise ValueError(f"penalties must be a non-empty list of values > 0, got {penalties}")
    if basis is not None:  # converted once for the whole path
        basis = basis.to(train.served_shifted.device, torch.float64)
    best = fit_bias_at_penalty(train, math.inf, bounds=bounds, fit_bias=False)
    walk = _PathWalk(validation, best, patience)
    head_scores: dict[float, float] = {}
    if basis is not None:
        head_scores = walk.run(
            ordered,
            lambda penalty, start: fit_bias_at_penalty(
                train,
                math.inf,
                basis=basis,
                head_penalty=penalty,
                bounds=bounds,
                start=start,
                fit_bias=False,
            ),
        )
    head_penalty = walk.best.head_penalty
    head_basis = basis if math.isfinite(head_penalty) else None
    scores = {math.inf: walk.first_kl} | walk.run(
        ordered,
        lambda penalty, start: fit_bias_at_penalty(
            train,
            penalty,
            basis=head_basis,
            head_penalty=head_penalty,
            bounds=bounds,
            start=start,
        ),
    )
    return BiasPath(chosen=walk.best, validation_kl=scores, head_validation_kl=head_scores)


class _PathWalk:
    """The best fit so far on validation rows, over one or more penalty paths."""

    def __init__(self, validation: PairedRows, first: BiasFit, patience: int) -> None:
        self.validation = validation
        self.patience = patience
        self.best = first
        self.first_kl = self.best_kl = _validation_kl(validation, first.correction)

    def run(
        self, penalties: Sequence[float], fit_at: Callable[[float, BiasFit], BiasFit]
    ) -> dict[float, float]:
        """Fit at each penalty in order, warm-starting from the previous fit (the first from
        the best so far), and keep the best; returns the validation KL of each penalty."""
        scores: dict[float, float] = {}
        previous, worse = self.best, 0
        for penalty in penalties:
            previous = fit_at(penalty, previous)
            scores[penalty] = _validation_kl(self.validation, previous.correction)
            if scores[penalty] < self.best_kl:
                self.best, self.best_kl, worse = previous, scores[penalty], 0
            else:
                worse += 1
                if worse >= self.patience:
                    break
        return scores
