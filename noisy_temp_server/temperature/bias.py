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

Only what the objective needs is kept per row (`PairedRows`): the shifted served row, the clean
probabilities and three scalars, all on the rows' device; the heavy loops run over row chunks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from noisy_temp_server.temperature.rules import TemperatureBounds
from noisy_temp_server.temperature.stats import KLTerms

__all__ = [
    "DEFAULT_PENALTIES",
    "BiasEvaluation",
    "BiasFit",
    "BiasPath",
    "LogitBias",
    "PairedRows",
    "StreamingBias",
    "bias_file_name",
    "bias_sha256",
    "check_bias_vocabulary",
    "evaluate_bias",
    "fit_bias_at_penalty",
    "fit_logit_bias",
    "load_bias_file",
    "save_bias_file",
]

DEFAULT_PENALTIES: tuple[float, ...] = tuple(10.0 ** (-k / 2) for k in range(2, 15))
"""The penalty path, descending: 1e-1, 3.2e-2, ..., 1e-7."""

_MASKED_FLOOR = -1.0e4  # a served logit masked to -inf becomes this (exp underflows to 0)
_CHUNK_ELEMENTS = 1 << 22  # rows per chunk * vocab for the [rows, V] temporaries


@dataclass(frozen=True)
class PairedRows:
    """Paired clean/served rows in the form the bias objective reads; every field has N rows.

    served_shifted: float32 [N, V], z~ - max z~ (masked tokens at -1e4, where q is 0);
    clean_prob: float32 [N, V], p = softmax(z); neg_entropy: float64 [N], E_p[log p];
    served_mean: float64 [N], E_p[s]; clean_top: int64 [N], argmax z; sequence_id: int64 [N].
    """

    served_shifted: Tensor
    clean_prob: Tensor
    neg_entropy: Tensor
    served_mean: Tensor
    clean_top: Tensor
    sequence_id: Tensor

    @classmethod
    def from_logits(cls, clean: Tensor, served: Tensor, sequence_id: int | Tensor) -> PairedRows:
        """Rows of `[B, V]` clean and served logits (validated as `KLTerms.from_logits` does).

        Rows where the served row masks a token the clean row supports are left out: their KL
        is infinite for every bias and temperature.
        """
        terms = KLTerms.from_logits(clean.float(), served.float())
        keep = torch.isfinite(terms.served_mean_under_clean)
        prob = torch.softmax(clean.float(), dim=-1)
        ids = torch.as_tensor(sequence_id, dtype=torch.int64).expand(clean.shape[0])
        return cls(
            served_shifted=terms.served_shifted[keep].clamp(min=_MASKED_FLOOR),
            clean_prob=prob[keep],
            neg_entropy=terms.neg_entropy_clean[keep].double(),
            served_mean=terms.served_mean_under_clean[keep].double(),
            clean_top=clean.argmax(dim=-1)[keep],
            sequence_id=ids.to(clean.device)[keep],
        )

    def __len__(self) -> int:
        return int(self.served_shifted.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.served_shifted.shape[1])

    @classmethod
    def concat(cls, parts: Sequence[PairedRows]) -> PairedRows:
        """Rows of all `parts` in order (at least one part; same vocabulary)."""
        if not parts:
            raise ValueError("concat needs at least one part")
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def select(self, rows: Tensor) -> PairedRows:
        """The rows picked by a bool mask [N] or an index tensor."""
        rows = rows.to(self.served_shifted.device)
        return PairedRows(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def chunks(self) -> list[slice]:
        """Row slices whose [rows, V] temporaries stay near 4M elements."""
        step = max(1, _CHUNK_ELEMENTS // max(1, self.vocab_size))
        return [slice(start, start + step) for start in range(0, len(self), step)]


@dataclass(frozen=True)
class LogitBias:
    """The correction served as softmax((z~ + bias) / temperature).

    bias: float32 [V] (sum 0: softmax ignores a constant); temperature: > 0.
    """

    bias: Tensor
    temperature: float

    @classmethod
    def identity(cls, vocab_size: int, device: torch.device | str = "cpu") -> LogitBias:
        """No correction: b = 0, T = 1."""
        return cls(bias=torch.zeros(vocab_size, device=device), temperature=1.0)

    def apply(self, served: Tensor) -> Tensor:
        """`[B, V]` served logits -> the corrected logits (z~ + b) / T (a new tensor)."""
        return (served + self.bias.to(served)) / self.temperature


@dataclass(frozen=True)
class BiasFit:
    """One fit: the correction, the penalty it used (inf: no bias, T only), the objective's
    mean KL on the fit rows, and L-BFGS's function evaluations."""

    correction: LogitBias
    penalty: float
    fit_kl: float
    evaluations: int


@dataclass(frozen=True)
class BiasEvaluation:
    """A correction on rows: KL(p || corrected) float64 [N] and whether the corrected row's top
    token is the clean one, bool [N]."""

    kl: Tensor
    same_top: Tensor


def _objective(
    rows: PairedRows, u: Tensor, c: Tensor, penalty: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(F, dF/du, dF/dc) at (u, c): float64 scalars and float64 [V] (see the module docstring)."""
    c32 = c.to(torch.float32)
    u32 = float(u)
    lse_total = torch.zeros((), dtype=torch.float64, device=c.device)
    q_mean = torch.zeros_like(c32, dtype=torch.float64)
    q_served = torch.zeros((), dtype=torch.float64, device=c.device)
    for chunk in rows.chunks():
        served = rows.served_shifted[chunk]
        scaled = torch.add(c32, served, alpha=u32)  # u * s + c
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        q = scaled.sub_(lse).exp_()
        lse_total += lse.double().sum()
        q_mean += q.sum(dim=0, dtype=torch.float64)
        q_served += torch.einsum("bv,bv->b", q, served).double().sum()
    count = len(rows)
    p_mean = rows.clean_prob.sum(dim=0, dtype=torch.float64) / count
    value = (
        rows.neg_entropy.mean()
        - u * rows.served_mean.mean()
        - torch.dot(p_mean, c)
        + lse_total / count
        + 0.5 * penalty * torch.dot(c, c)
    )
    grad_u = q_served / count - rows.served_mean.mean()
    grad_c = q_mean / count - p_mean + penalty * c
    return value, grad_u, grad_c


def fit_bias_at_penalty(
    rows: PairedRows,
    penalty: float,
    *,
    bounds: TemperatureBounds | None = None,
    start: LogitBias | None = None,
    fit_bias: bool = True,
    fit_temperature: bool = True,
    max_evaluations: int = 200,
) -> BiasFit:
    """Minimise the penalised objective over (T, b) from `start` (default: b = 0, T = 1).

    `fit_bias=False` keeps b at `start`'s, `fit_temperature=False` keeps T at `start`'s. T ends
    in `bounds` (default `TemperatureBounds()`): if the free optimum lies outside, T is clamped
    to the nearer bound and b refitted there. `penalty` must be > 0 when the bias is fitted.
    """
    if not len(rows):
        raise ValueError("cannot fit a bias on zero rows")
    if fit_bias and not penalty > 0:
        raise ValueError(f"the penalty must be > 0 to fit a bias, got {penalty}")
    bounds = bounds or TemperatureBounds()
    device = rows.served_shifted.device
    start = start or LogitBias.identity(rows.vocab_size, device)
    penalty_used = penalty if fit_bias else 0.0
    # L-BFGS on y = x * scale, x = (u, c): the scale is the square root of the Hessian's
    # diagonal at p (Var_p(s) for u, mean p + penalty for c), so that u (curvature ~ the
    # logits' variance) and c (curvature ~ a token's probability) are equally well resolved.
    scale = _diagonal_curvature(rows, penalty_used).sqrt()
    free = torch.cat(
        [
            torch.full((1,), float(fit_temperature), dtype=torch.float64, device=device),
            torch.full((rows.vocab_size,), float(fit_bias), dtype=torch.float64, device=device),
        ]
    )
    x0 = torch.cat(
        [
            torch.tensor([1.0 / start.temperature], dtype=torch.float64, device=device),
            start.bias.to(device, torch.float64) / start.temperature,
        ]
    )
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
            x = y / scale
            value, grad_u, grad_c = _objective(rows, x[0], x[1:], penalty_used)
            y.grad = torch.cat([grad_u.reshape(1), grad_c]) * free / scale
        return value

    optimizer.step(closure)
    x = (y / scale).detach()
    u, c = float(x[0]) if fit_temperature else 1.0 / start.temperature, x[1:]
    u_bounded = min(max(u, 1.0 / bounds.t_max), 1.0 / bounds.t_min)
    if fit_temperature and u_bounded != u:
        clamped = LogitBias(bias=(c / u).to(torch.float32), temperature=1.0 / u_bounded)
        refit = fit_bias_at_penalty(
            rows,
            penalty,
            bounds=bounds,
            start=clamped,
            fit_bias=fit_bias,
            fit_temperature=False,
            max_evaluations=max_evaluations,
        )
        return BiasFit(
            refit.correction, refit.penalty, refit.fit_kl, evaluations + refit.evaluations
        )
    with torch.no_grad():
        kl = float(
            _objective(rows, torch.tensor(u, dtype=torch.float64, device=c.device), c, 0.0)[0]
        )
    bias = (c / u).to(torch.float32)
    correction = LogitBias(bias=bias - bias.mean(), temperature=1.0 / u)
    return BiasFit(correction, penalty if fit_bias else math.inf, kl, evaluations)


def _diagonal_curvature(rows: PairedRows, penalty: float) -> Tensor:
    """float64 [V + 1]: the objective's Hessian diagonal at q = p, (mean Var_p(s), mean p +
    penalty); entries are floored at 1e-12 so the scaling stays finite."""
    second_moment = torch.zeros((), dtype=torch.float64, device=rows.served_shifted.device)
    for chunk in rows.chunks():
        served = rows.served_shifted[chunk]
        moment = torch.einsum("bv,bv->b", rows.clean_prob[chunk], served.square())
        second_moment += moment.double().sum()
    var_u = second_moment / len(rows) - rows.served_mean.square().mean()
    p_mean = rows.clean_prob.sum(dim=0, dtype=torch.float64) / len(rows)
    return torch.cat([var_u.reshape(1), p_mean + penalty]).clamp(min=1e-12)


@torch.no_grad()
def evaluate_bias(rows: PairedRows, correction: LogitBias) -> BiasEvaluation:
    """Per-row KL(p || softmax((z~ + b) / T)) and same-top of `correction` on `rows`."""
    u = 1.0 / correction.temperature
    c = correction.bias.to(rows.served_shifted) * u
    kls, tops = [], []
    for chunk in rows.chunks():
        scaled = rows.served_shifted[chunk] * u + c
        lse = torch.logsumexp(scaled, dim=-1).double()
        tops.append(scaled.argmax(dim=-1) == rows.clean_top[chunk])
        linear = rows.clean_prob[chunk] @ c
        kl = rows.neg_entropy[chunk] - u * rows.served_mean[chunk] - linear.double() + lse
        kls.append(kl.clamp(min=0.0))
    return BiasEvaluation(kl=torch.cat(kls), same_top=torch.cat(tops))


def _validation_kl(rows: PairedRows, correction: LogitBias) -> float:
    return float(evaluate_bias(rows, correction).kl.mean())


@dataclass(frozen=True)
class BiasPath:
    """`fit_logit_bias`'s result: the chosen fit, and the validation mean KL of every penalty
    tried (inf: T only), in the order tried."""

    chosen: BiasFit
    validation_kl: dict[float, float]


def fit_logit_bias(
    train: PairedRows,
    validation: PairedRows,
    *,
    penalties: Sequence[float] = DEFAULT_PENALTIES,
    bounds: TemperatureBounds | None = None,
    patience: int = 2,
) -> BiasPath:
    """Fit (b, T) on `train` for each penalty (descending, each warm-started from the previous
    fit) and keep the one with the lowest mean KL on `validation`; a T-only fit (no bias)
    competes too and wins ties, so the result is never worse on `validation` than the best
    single temperature. The path stops once `patience` penalties in a row were worse on
    validation than the best so far (the validation KL is convex-shaped along the path).
    """
    ordered = sorted(penalties, reverse=True)
    if not ordered or ordered[-1] <= 0:
        raise ValueError(f"penalties must be a non-empty list of values > 0, got {penalties}")
    best = fit_bias_at_penalty(train, math.inf, bounds=bounds, fit_bias=False)
    best_kl = _validation_kl(validation, best.correction)
    scores = {math.inf: best_kl}
    previous, worse = best, 0
    for penalty in ordered:
        fit = fit_bias_at_penalty(train, penalty, bounds=bounds, start=previous.correction)
        scores[penalty] = _validation_kl(validation, fit.correction)
        previous = fit
        if scores[penalty] < best_kl:
            best, best_kl, worse = fit, scores[penalty], 0
        else:
            worse += 1
            if worse >= patience:
                break
    return BiasPath(chosen=best, validation_kl=scores)


class StreamingBias:
    """Refines (T, b) from a stream of row batches with O(V) state: per batch, one diagonally
    preconditioned gradient step on the same penalised objective as `fit_bias_at_penalty`,

        x <- x - step * dF/dx / h,    x = (u, c) = (1/T, b/T),

    where h is a running mean of the Hessian's diagonal at p (Var_p(s) for u, mean p + penalty
    for c; `_diagonal_curvature`), each batch weighted by its rows. Only `x` and `h` are kept
    (2 (V + 1) float64), never the rows; T stays in `bounds`.
    """

    def __init__(
        self,
        start: LogitBias,
        penalty: float,
        *,
        bounds: TemperatureBounds | None = None,
        step: float = 0.5,
    ) -> None:
        if not penalty > 0 or not 0 < step <= 1:
            raise ValueError(f"need penalty > 0 and 0 < step <= 1, got {penalty}, {step}")
        self.penalty = penalty
        self.bounds = bounds or TemperatureBounds()
        self.step = step
        u = 1.0 / start.temperature
        bias = start.bias.detach().to(torch.float64)
        self._x = torch.cat([torch.tensor([u], dtype=torch.float64, device=bias.device), bias * u])
        self._curvature = torch.zeros_like(self._x)
        self.rows_seen = 0

    @torch.no_grad()
    def update(self, rows: PairedRows) -> None:
        """One step on `rows` (at least one row, on the start's device)."""
        if not len(rows):
            raise ValueError("cannot update on zero rows")
        self.rows_seen += len(rows)
        weight = len(rows) / self.rows_seen
        curvature = _diagonal_curvature(rows, self.penalty)
        self._curvature.mul_(1 - weight).add_(curvature, alpha=weight)
        _, grad_u, grad_c = _objective(rows, self._x[0], self._x[1:], self.penalty)
        self._x.sub_(torch.cat([grad_u.reshape(1), grad_c]) / self._curvature * self.step)
        self._x[0].clamp_(1.0 / self.bounds.t_max, 1.0 / self.bounds.t_min)

    @property
    def correction(self) -> LogitBias:
        """The current (T, b), b centred (softmax ignores a constant)."""
        u = float(self._x[0])
        bias = (self._x[1:] / u).to(torch.float32)
        return LogitBias(bias=bias - bias.mean(), temperature=1.0 / u)


def bias_sha256(bias: Tensor) -> str:
    """Content hash of a bias vector: sha256 of its float32 little-endian bytes."""
    data = bias.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return hashlib.sha256(data).hexdigest()


def check_bias_vocabulary(bias: Tensor, vocab_size: int | None, where: str) -> None:
    """ValueError unless `bias` has one entry per token of the vocabulary of `where` (named in
    the message), `vocab_size` tokens (None: unknown, which no bias fits): a bias fitted for
    another model."""
    if bias.numel() != vocab_size:
        raise ValueError(
            f"the per-token bias {bias_sha256(bias)[:16]}... has {bias.numel()} entries but "
            f"{where} has a vocabulary of {vocab_size} tokens; it was fitted for another model"
        )


def bias_file_name(sha256: str) -> str:
    """The file a bias vector is stored in, named by its content hash."""
    return f"bias-{sha256[:16]}.safetensors"


def save_bias_file(folder: Path, bias: Tensor) -> Path:
    """Write `bias` (float32 [V]) to `folder / bias_file_name(sha256)`; returns the path."""
    path = Path(folder) / bias_file_name(bias_sha256(bias))
    save_file({"bias": bias.detach().to("cpu", torch.float32).contiguous()}, str(path))
    return path


def load_bias_file(folder: Path, sha256: str) -> Tensor:
    """The bias vector with content hash `sha256` that `save_bias_file` wrote to `folder`
    (float32 [V], finite); ValueError when the file is missing or unreadable, or does not hold
    that vector (it was changed)."""
    path = Path(folder) / bias_file_name(sha256)
    try:
        bias = load_file(str(path))["bias"]
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"cannot read bias file {path}: {error}") from error
    if bias.dim() != 1 or bias.dtype != torch.float32 or not bool(bias.isfinite().all()):
        raise ValueError(f"bias file {path} does not hold a finite float32 vector")
    if bias_sha256(bias) != sha256:
        raise ValueError(f"bias file {path} does not hold the bias with sha256 {sha256[:16]}...")
    return bias
