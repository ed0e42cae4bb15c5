"""The online refinement of a per-token logit bias + T (`correction.bias`) from a stream of
shadow-scored row batches, with state of the vocabulary's size and never the rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from noisy_temp_server.correction.bias import diagonal_curvature
from noisy_temp_server.correction.files import check_bias_vocabulary
from noisy_temp_server.correction.paired_rows import (
    CHUNK_ELEMENTS,
    LogitBias,
    PairedRows,
    kl_objective,
)
from noisy_temp_server.correction.request_bands import BandedBias
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = ["StreamingBias"]


class StreamingBias:
    """Refines a correction (T, b) from a stream of row batches with O(V) state: per batch,
    one diagonally preconditioned stochastic Newton step on the objective of
    `correction.bias.fit_bias_at_penalty` with the penalties on the change of c from the start
    (so what the start learnt is refined, not shrunk towards 0),

        F(u, c) = mean_i KL_i(u, c) + (a * penalty / 2) * |r|^2 [+ (a * head_penalty / 2) * |g|^2],
        c = c_start + W g + r,    x = (u, c) = (1/T, b/T),
        x <- x - w * dF/dx / h,    w = rows / min(prior_rows + seen, memory_rows),
        a = min(prior_rows, memory_rows) / min(prior_rows + seen, memory_rows)   (1 without
        prior rows),

    where h is the mean over the rows seen of the KL's Hessian diagonal at p (Var_p(s) for u,
    mean p for c; `correction.bias.diagonal_curvature`) plus a * penalty for c, and `seen`
    counts the rows so far, this batch's included. The step shrinks as 1/seen, so x tends to
    the optimum over all rows
    seen and the start's `prior_rows` (the rows it was fitted on), as a batch fit would: a
    constant step instead follows each small batch's noise, and on rows as peaked as a language
    model's (a token carries mass in one batch and none in the next) it walks off, far worse
    than its start. Past `memory_rows` the weights stop shrinking: the fit then follows the most
    recent rows of that order, so a change of traffic is learnt.

    The penalties are the start's, chosen on validation for its `prior_rows`; they weigh as
    those rows do among all the rows seen (`a`), as the start's prior would in a batch fit of
    every row (the mean objective's penalty falls as 1/rows), so the anchor to the start
    weakens as traffic outnumbers the rows it was fitted on (held at full strength, it would
    keep the fit at the start's penalty however many rows came). Since the
    1/seen steps average targets whose penalty fell as they came, x lags the optimum at the
    current `a`. A row is counted as one, though rows of similar prompts carry less than rows
    of new ones.

    With a `basis` W [V, d] (the clean output head) and a `head_penalty`, each batch first takes
    a step in W's span (`_HeadSpanSteps`: d numbers learnt from every token's gradient, where
    the per-token step learns each token from its own), then the per-token step on the
    residual r. State: `x`, `c_start`, `h` (3 (V + 1) float64), with a basis also W g (V) and
    d x d float64, never the rows; T stays in `bounds`.

    With `band_temperatures` (the start's T at request temperatures T_r other than 1, the bias
    served in bands: `BandedBias`), each band's u_r = 1/T_r-band takes the same weighted Newton
    step after (T, b)'s, on the batch taken to T_r with the new b held fixed (the objective of
    `correction.request_bands.best_temperature`; its curvature a running mean like h), so the bands
    follow the bias on the same rows.
    """

    def __init__(
        self,
        start: LogitBias,
        penalty: float,
        *,
        basis: Tensor | None = None,
        head_penalty: float | None = None,
        bounds: TemperatureBounds | None = None,
        prior_rows: int = 0,
        memory_rows: int = 65536,
        band_temperatures: Mapping[float, float] | None = None,
    ) -> None:
        if not penalty > 0 or prior_rows < 0 or memory_rows < 1:
            raise ValueError(
                "need penalty > 0, prior_rows >= 0 and memory_rows >= 1, got "
                f"{penalty}, {prior_rows}, {memory_rows}"
            )
        self.penalty = penalty
        self.bounds = bounds or TemperatureBounds()
        self.prior_rows = prior_rows
        self.memory_rows = memory_rows
        u = 1.0 / start.temperature
        bias = start.bias.detach().to(torch.float64)
        self._x = torch.cat([torch.tensor([u], dtype=torch.float64, device=bias.device), bias * u])
        self._anchor = self._x[1:].clone()
        self._curvature = torch.zeros_like(self._x)
        self._head = None
        if basis is not None and head_penalty is not None:
            check_bias_vocabulary(start.bias, basis.shape[0], "the head basis")
            self._head = _HeadSpanSteps(basis.to(bias.device), head_penalty, memory_rows)
        # the bands other than T_r = 1: request temperature -> [u, curvature]
        self._bands = {
            t_r: [1.0 / t, 0.0] for t_r, t in (band_temperatures or {}).items() if t_r != 1.0
        }
        self.rows_seen = 0

    @torch.no_grad()
    def update(self, rows: PairedRows) -> None:
        """One step on `rows` (at least one row, on the start's device)."""
        if not len(rows):
            raise ValueError("cannot update on zero rows")
        self.rows_seen += len(rows)
        in_mean = min(1.0, len(rows) / min(self.rows_seen, self.memory_rows))
        weight = min(1.0, len(rows) / min(self.prior_rows + self.rows_seen, self.memory_rows))
        anchor = self.anchor_share
        residual_anchor = self._anchor
        if self._head is not None:
            _, _, grad_c = kl_objective(rows, self._x[0], self._x[1:])
            self._x[1:] += self._head.step(rows, grad_c, (in_mean, weight), self.rows_seen, anchor)
            residual_anchor = self._anchor + self._head.shift
        self._curvature.mul_(1 - in_mean).add_(diagonal_curvature(rows), alpha=in_mean)
        curvature = self._curvature.clone()
        curvature[1:] += anchor * self.penalty
        _, grad_u, grad_c = kl_objective(rows, self._x[0], self._x[1:])
        grad_c += anchor * self.penalty * (self._x[1:] - residual_anchor)
        step = torch.cat([grad_u.reshape(1), grad_c]) / curvature.clamp(min=1e-12)
        self._x.sub_(step * weight)
        self._x[0].clamp_(1.0 / self.bounds.t_max, 1.0 / self.bounds.t_min)
        self._step_bands(rows, in_mean, weight)

    def _step_bands(self, rows: PairedRows, in_mean: float, weight: float) -> None:
        """Each band's step: with y = s + b, the clean row at T_r p_r = softmax(log p / T_r)
        and q = softmax(u y / T_r), the mean KL's derivatives in u are E_q[y / T_r] -
        E_p_r[y / T_r] and Var_q(y / T_r) (`KLTerms` on the rows taken to T_r; computed from
        log p and y once per chunk, not per band)."""
        if not self._bands:
            return
        bias = self.correction.bias.to(rows.served_shifted)
        sums = {request_temperature: [0.0, 0.0] for request_temperature in self._bands}
        for chunk in rows.chunks():
            log_prob = rows.clean_prob[chunk].log()
            served = rows.served_shifted[chunk] + bias
            for request_temperature, (u, _) in self._bands.items():
                clean = torch.softmax(log_prob / request_temperature, dim=-1)
                q = torch.softmax(served * (u / request_temperature), dim=-1)
                mean_q = torch.einsum("bv,bv->b", q, served)
                slope = mean_q - torch.einsum("bv,bv->b", clean, served)
                spread = (served - mean_q.unsqueeze(-1)).square_()
                curvature = torch.einsum("bv,bv->b", q, spread)
                sums[request_temperature][0] += float(slope.sum()) / request_temperature
                sums[request_temperature][1] += float(curvature.sum()) / request_temperature**2
        for request_temperature, band in self._bands.items():
            mean_slope, mean_curvature = (total / len(rows) for total in sums[request_temperature])
            band[1] = (1 - in_mean) * band[1] + in_mean * mean_curvature
            stepped = band[0] - weight * mean_slope / max(band[1], 1e-12)
            band[0] = min(max(stepped, 1.0 / self.bounds.t_max), 1.0 / self.bounds.t_min)

    @property
    def anchor_share(self) -> float:
        """The share `a` of the start's penalties in force now: its rows' share of all the
        rows seen (within the memory; never above 1), 1 without prior rows."""
        if not self.prior_rows:
            return 1.0
        remembered = min(self.prior_rows + self.rows_seen, self.memory_rows)
        return min(self.prior_rows, self.memory_rows) / remembered

    @property
    def steps_in_head_span(self) -> bool:
        """Whether each update steps in the output head's span too (a basis was given)."""
        return self._head is not None

    @property
    def correction(self) -> LogitBias:
        """The current (T, b), b centred (softmax ignores a constant)."""
        u = float(self._x[0])
        bias = (self._x[1:] / u).to(torch.float32)
        return LogitBias(bias=bias - bias.mean(), temperature=1.0 / u)

    @property
    def banded(self) -> BandedBias:
        """The current correction with its T at every request temperature it refines (T_r = 1:
        the correction's own)."""
        correction = self.correction
        bands = {t_r: 1.0 / band[0] for t_r, band in self._bands.items()}
        bands[1.0] = correction.temperature
        return BandedBias(correction, dict(sorted(bands.items())))


class _HeadSpanSteps:
    """`StreamingBias`'s steps in the span of the output head W [V, d]: c += W dg with

        dg = -w * H^-1 (W^T dF/dc + a * head_penalty * g),
        H = W^T (mean diag(p) - mean p p^T) W + a * head_penalty * I,

    H being F's Hessian in g at q = p, from running means over the rows seen (mean p [V] and
    mean (W^T p)(W^T p)^T [d, d]), `a` the anchor's share then (`StreamingBias.anchor_share`).
    Assembling H costs V d^2 (float64, in chunks of tokens), so
    its Cholesky factor is renewed only when the rows seen have doubled since the last, or
    `memory_rows` more have come (about log2 of the rows seen times, then once per memory); if
    rounding leaves H not positive definite, the diagonal is raised until it is. The per-batch
    cost is two [V, d] products with vectors and one with the batch's p. `shift` (float64 [V])
    is W g, the change of c in the span so far.
    """

    def __init__(self, basis: Tensor, head_penalty: float, memory_rows: int) -> None:
        if not head_penalty > 0:
            raise ValueError(f"need head_penalty > 0, got {head_penalty}")
        self.basis = basis.detach().to(torch.float32)
        self.penalty = head_penalty
        vocab, d = self.basis.shape
        device = self.basis.device
        self.g = torch.zeros(d, dtype=torch.float64, device=device)
        self.shift = torch.zeros(vocab, dtype=torch.float64, device=device)
        self._p_mean = torch.zeros(vocab, dtype=torch.float64, device=device)
        self._outer = torch.zeros(d, d, dtype=torch.float64, device=device)
        self._memory_rows = memory_rows
        self._factor: Tensor | None = None
        self._factored_at = 0

    def step(
        self,
        rows: PairedRows,
        grad_c: Tensor,
        weights: tuple[float, float],
        rows_seen: int,
        anchor_share: float,
    ) -> Tensor:
        """Observe `rows` and return the change of c; `weights`: the rows' weight in the running
        means, then the step's; `anchor_share`: `a` (`StreamingBias.update`)."""
        in_mean, weight = weights
        projected = torch.cat([rows.clean_prob[chunk] @ self.basis for chunk in rows.chunks()])
        projected = projected.double()
        p_mean = rows.clean_prob.sum(dim=0, dtype=torch.float64) / len(rows)
        self._p_mean.mul_(1 - in_mean).add_(p_mean, alpha=in_mean)
        self._outer.mul_(1 - in_mean).add_(projected.T @ projected / len(rows), alpha=in_mean)
        due = min(2 * self._factored_at, self._factored_at + self._memory_rows)
        penalty = anchor_share * self.penalty
        if self._factor is None or rows_seen >= due:
            self._factor = self._factorise(penalty)
            self._factored_at = rows_seen
        grad = (self.basis.T @ grad_c.to(torch.float32)).double() + penalty * self.g
        delta = -weight * torch.cholesky_solve(grad[:, None], self._factor)[:, 0]
        self.g += delta
        change = (self.basis @ delta.to(torch.float32)).double()
        self.shift += change
        return change

    def hessian(self, penalty: float) -> Tensor:
        """H (float64 [d, d]) from the running means so far, at `penalty` (a * head_penalty)."""
        d = self.basis.shape[1]
        hessian = -self._outer.clone()
        for start in range(0, self.basis.shape[0], CHUNK_ELEMENTS // d):
            rows = self.basis[start : start + CHUNK_ELEMENTS // d].double()
            hessian += rows.T @ (rows * self._p_mean[start : start + len(rows), None])
        hessian.diagonal().add_(penalty)
        return (hessian + hessian.T) / 2

    def _factorise(self, penalty: float) -> Tensor:
        hessian = self.hessian(penalty)
        jitter = penalty
        factor, info = torch.linalg.cholesky_ex(hessian)
        while int(info):
            hessian.diagonal().add_(jitter)
            jitter *= 10
            factor, info = torch.linalg.cholesky_ex(hessian)
        return factor
