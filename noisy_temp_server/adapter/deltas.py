"""Fitting one layer's low-rank compensation: the error E = W_clean - W_served by a rank-r
product up @ down (torch only).

Two methods:

- `svd_delta`: the truncated SVD of E, the best rank-r approximation in Frobenius norm (the
  plain baseline, "LoRC");
- `eora_delta`: activation-aware (EoRA). With the layer's input second moment C = X^T X / n
  and its ridged form C_r = C + ridge * mean(eigenvalues of C) I = S S^T for any square root
  S (EoRA writes S = Q diag(lam_r)^{1/2} from the eigendecomposition; the Cholesky factor L
  used here gives the same product for about a thirtieth of the work), the error is
  projected, E' = E S, truncated to rank r by its SVD U_r S_r V_r^T, and mapped back:
  up = U_r S_r, down = V_r^T S^{-1}. Since ||M S||_F^2 = tr(M C_r M^T), up @ down minimises
  tr((E - D) C_r (E - D)^T) over rank-r D: the output error on the inputs X, ridged towards
  the plain Frobenius error (ridge -> infinity gives `svd_delta`).

Both compute in float64 and return float32 deltas.
"""

from __future__ import annotations

import torch
from torch import Tensor

from noisy_temp_server.adapter.lora import LowRankDelta

__all__ = [
    "TRUNCATION_RIDGE",
    "eora_delta",
    "propagated_delta",
    "propagated_error",
    "svd_delta",
    "weighted_error",
]

TRUNCATION_RIDGE = 1e-3
"""The ridge of the input second moment in which `propagated_delta` truncates each layer's target
(times its mean eigenvalue): small, so the truncation weighs the directions the inputs use."""


def _check(error: Tensor, rank: int) -> None:
    if error.ndim != 2:
        raise ValueError(f"the error must be a matrix [out, in], got {tuple(error.shape)}")
    if not 1 <= rank <= min(error.shape):
        raise ValueError(f"rank {rank} must be between 1 and {min(error.shape)} for this layer")


def _ridged(second_moment: Tensor, ridge: float) -> tuple[Tensor, float]:
    """(C + rho I, rho) in float64, for C the symmetrised `second_moment` and rho = `ridge`
    times its mean eigenvalue. ValueError for a ridge <= 0 or a zero second moment."""
    if not ridge > 0:
        raise ValueError(f"the ridge must be > 0, got {ridge}")
    moment = second_moment.double()
    moment = (moment + moment.T) / 2
    mean = float(torch.diagonal(moment).mean())  # the mean eigenvalue: trace / in
    if not mean > 0:
        raise ValueError("the second moment is zero: the layer saw no input")
    shift = ridge * mean
    return moment + shift * torch.eye(len(moment), dtype=moment.dtype, device=moment.device), shift


def svd_delta(error: Tensor, rank: int) -> LowRankDelta:
    """The truncated SVD of `error` [out, in] at `rank`: up = U_r S_r, down = V_r^T.
    ValueError for a non-matrix or a rank outside [1, min(out, in)]."""
    _check(error, rank)
    u, s, vh = torch.linalg.svd(error.double(), full_matrices=False)
    return LowRankDelta(down=vh[:rank].float().contiguous(), up=(u[:, :rank] * s[:rank]).float())


def eora_delta(error: Tensor, second_moment: Tensor, rank: int, ridge: float) -> LowRankDelta:
    """The activation-aware rank-`rank` delta of `error` [out, in] for inputs whose second
    moment X^T X / n is `second_moment` [in, in] (symmetric, positive semi-definite), ridged
    by `ridge` (> 0) times its mean eigenvalue (see the module docstring). ValueError for
    shapes that do not match, a rank outside [1, min(out, in)], a ridge <= 0 or a zero
    second moment."""
    _check(error, rank)
    columns = error.shape[1]
    if second_moment.shape != (columns, columns):
        raise ValueError(
            f"second moment {tuple(second_moment.shape)} does not match the error's "
            f"{columns} input features"
        )
    regularised, _ = _ridged(second_moment, ridge)
    lower = torch.linalg.cholesky(regularised)  # C + ridge mean I = L L^T
    u, s, vh = torch.linalg.svd(error.double() @ lower, full_matrices=False)
    down = torch.linalg.solve_triangular(lower, vh[:rank], upper=False, left=False)
    return LowRankDelta(down=down.float().contiguous(), up=(u[:, :rank] * s[:rank]).float())


def propagated_error(
    clean_weight: Tensor,
    served_weight: Tensor,
    second_moment: Tensor,
    cross_moment: Tensor,
    ridge: float,
) -> Tensor:
    """The error E' [out, in] whose EoRA fit (`eora_delta(E', second_moment, rank, ridge)`)
    makes the served layer reproduce the clean layer's outputs on the clean model's inputs.

    With the served model's inputs X_s, the clean model's X_c at the same positions,
    A = X_s^T X_s / n (`second_moment`) and B = X_s^T X_c / n (`cross_moment`), the delta D
    minimising ||X_c W_c^T - X_s (W_s + D)^T||^2 / n + rho ||D - (W_c - W_s)||^2 (rho = `ridge`
    times A's mean eigenvalue) is E' = W_c (B + rho I)^T (A + rho I)^{-1} - W_s, and the whole
    objective is tr((D - E')(A + rho I)(D - E')^T) plus a constant, which `eora_delta`
    minimises over rank-r D. With X_c = X_s it is the plain error W_c - W_s. ValueError for
    shapes that do not match, a ridge <= 0 or a zero second moment."""
    columns = served_weight.shape[1]
    if second_moment.shape != (columns, columns) or cross_moment.shape != (columns, columns):
        raise ValueError(
            f"moments {tuple(second_moment.shape)} and {tuple(cross_moment.shape)} do not match "
            f"the layer's {columns} input features"
        )
    regularised, shift = _ridged(second_moment, ridge)
    device = regularised.device
    target = (
        clean_weight.double()
        @ (cross_moment.double() + shift * torch.eye(columns, dtype=torch.float64, device=device)).T
    )
    lower = torch.linalg.cholesky(regularised)
    return torch.cholesky_solve(target.T, lower).T - served_weight.double()


def propagated_delta(
    clean_weight: Tensor,
    served_weight: Tensor,
    second_moment: Tensor,
    cross_moment: Tensor,
    *,
    rank: int,
    ridge: float,
) -> LowRankDelta:
    """The rank-`rank` delta of the ``propagated`` fit: `propagated_error` with `ridge`,
    truncated by `eora_delta` with `TRUNCATION_RIDGE`. Every tensor on one device; the work is
    done there. ValueError as for those two."""
    error = propagated_error(clean_weight, served_weight, second_moment, cross_moment, ridge)
    return eora_delta(error, second_moment, rank, TRUNCATION_RIDGE)


def weighted_error(error: Tensor, delta: LowRankDelta | None, second_moment: Tensor) -> float:
    """tr(R C R^T) with R = error - delta (or error alone for None): the mean squared output
    error of the layer on inputs of second moment C."""
    residual = error.double() - (0.0 if delta is None else delta.dense().double())
    return float(((residual @ second_moment.double()) * residual).sum())
