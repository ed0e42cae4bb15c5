"""A low-rank linear correction of the served row inside the output head's span.

Where the output head W [V, d] is the same in the clean and the served model (weight
quantization and weight noise leave it alone by default, `pairs.perturbation`), every logits row
is W h + c·1 for a final hidden state h, and the served row's error W (h - h~) lies in the
head's span. The per-token bias's head-span part learns the mean of h - h~; part of the rest
is a linear function of h~ that is the same on every prompt. `HeadMap` adds W M h~ to the
served row, M [d, d] fitted by ridge least squares of h - h~ on h~ over paired rows and cut to
its leading `rank` singular directions. The coordinates h~ are read off the served row itself
(`head_coordinates`, blind to the row's constant), so applying it needs the row only:

    z~ -> z~ + left @ (right @ z~),   left = W U_r S_r  [V, r],   right = V_r^T P  [r, V]

(M = U S V^T, P: the coordinates). The map has no constant part: the bias fitted on top of it
(`calibration.bias_fit.calibrate_bias`) keeps its own. It costs 2 r V multiply-adds per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.correction.paired_rows import (
    MASKED_FLOOR,
    LogitBias,
    PairedRows,
    evaluate_bias,
)
from noisy_temp_server.temperature.stats import KLTerms

__all__ = [
    "DEFAULT_MAP_PENALTIES",
    "HeadMap",
    "HeadMapFit",
    "fit_head_map",
    "head_coordinates",
]

DEFAULT_MAP_PENALTIES: tuple[float, ...] = tuple(10.0 ** (k / 2) for k in range(-4, 7))
"""Ridge penalties tried, in units of the served coordinates' variance: 1e-2 ... 1e3."""

# a clean probability below float32's smallest normal number is read as that number (its
# logit's true value is lost; the row's coordinates are then off by its share)
_CLEAN_PROB_FLOOR = torch.finfo(torch.float32).tiny


def head_coordinates(basis: Tensor) -> Tensor:
    """P [d, V] (float64) with P (W h + c·1) = h for every h and c: the first d rows of the
    pseudo-inverse of [W, 1] (`basis` W [V, d], full column rank with 1 outside its span)."""
    augmented = torch.cat(
        [basis.double(), torch.ones(basis.shape[0], 1, dtype=torch.float64, device=basis.device)],
        dim=1,
    )
    gram = augmented.T @ augmented
    return torch.linalg.solve(gram, augmented.T)[:-1]


@dataclass(frozen=True)
class HeadMap:
    """z~ -> z~ + left @ (right @ z~) (module docstring): left float32 [V, r], right float32
    [r, V]; `right` ignores a constant added to the row, so the row may be max-shifted."""

    left: Tensor
    right: Tensor

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.left.shape[0])

    def to(self, device: torch.device | str) -> HeadMap:
        """This map on `device` (itself when it is there already)."""
        if self.left.device == torch.device(device):
            return self
        return HeadMap(left=self.left.to(device), right=self.right.to(device))

    def apply(self, served: Tensor) -> Tensor:
        """[B, V] served logits -> the mapped logits (a new tensor)."""
        return served + (served @ self.right.to(served).T) @ self.left.to(served).T

    def mapped(self, rows: PairedRows) -> PairedRows:
        """`rows` with every served row mapped (the clean side unchanged); the rows must have no
        masked token (their coordinates would be wrong; calibration rows have none)."""
        terms = [
            KLTerms.from_clean_prob(
                rows.clean_prob[chunk],
                rows.neg_entropy[chunk],
                self.apply(rows.served_shifted[chunk]),
            )
            for chunk in rows.chunks()
        ]
        return PairedRows(
            served_shifted=torch.cat([t.served_shifted for t in terms]).clamp(min=MASKED_FLOOR),
            clean_prob=rows.clean_prob,
            neg_entropy=rows.neg_entropy,
            served_mean=torch.cat([t.served_mean_under_clean for t in terms]).double(),
            clean_top=rows.clean_top,
            sequence_id=rows.sequence_id,
        )


@dataclass(frozen=True)
class HeadMapFit:
    """The map fitted at the penalty with the lowest mean KL on the selection rows
    (`fit_head_map`), and that KL at every penalty tried (each map served with the constant its
    fit predicts, which the bias fitted on top learns)."""

    head_map: HeadMap
    penalty: float
    selection_kl: dict[float, float]


@dataclass(frozen=True)
class _Regression:
    """Ridge regression of the coordinates' error h - h~ on the served coordinates h~, both
    centred, for any penalty: the means, the served coordinates' eigenbasis, X^T (Y - X), and
    the penalty's unit (the served coordinates' variance, times the rows)."""

    served_mean: Tensor
    error_mean: Tensor
    eigenvalues: Tensor
    eigenvectors: Tensor
    cross: Tensor
    scale: float

    @classmethod
    def of(cls, rows: PairedRows, coordinates: Tensor) -> _Regression:
        served, clean = _row_coordinates(rows, coordinates)
        served_mean = served.mean(dim=0)
        error = clean - served
        error_mean = error.mean(dim=0)
        served_centred = served - served_mean
        eigenvalues, eigenvectors = torch.linalg.eigh(served_centred.T @ served_centred)
        return cls(
            served_mean=served_mean,
            error_mean=error_mean,
            eigenvalues=eigenvalues,
            eigenvectors=eigenvectors,
            cross=served_centred.T @ (error - error_mean),
            scale=float(served_centred.pow(2).mean()) * len(rows),
        )

    def matrix(self, penalty: float) -> Tensor:
        """M [d, d] at `penalty`: error ≈ M (h~ - served_mean) + error_mean."""
        q = self.eigenvectors
        inverse = q / (self.eigenvalues + penalty * self.scale)
        return (inverse @ (q.T @ self.cross)).T


def _row_coordinates(rows: PairedRows, coordinates: Tensor) -> tuple[Tensor, Tensor]:
    """The served and clean coordinates of `rows` (float64 [N, d] each)."""
    served, clean = [], []
    p = coordinates.to(rows.served_shifted.device)
    for chunk in rows.chunks():
        served.append(rows.served_shifted[chunk].double() @ p.T)
        clean_logits = rows.clean_prob[chunk].double().clamp(min=_CLEAN_PROB_FLOOR).log()
        clean.append(clean_logits @ p.T)
    return torch.cat(served), torch.cat(clean)


def _truncated(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """(U_r S_r [d, r], V_r^T [r, d]): `matrix` cut to its leading `rank` singular directions."""
    u, s, vh = torch.linalg.svd(matrix)
    return u[:, :rank] * s[:rank], vh[:rank]


def _check_unmasked(rows: PairedRows, name: str) -> None:
    if bool((rows.served_shifted <= MASKED_FLOOR).any()):
        raise ValueError(f"the {name} rows have masked tokens; a head map is fitted without")


def fit_head_map(
    fit: PairedRows,
    selection: PairedRows,
    basis: Tensor,
    rank: int,
    penalties: Sequence[float] = DEFAULT_MAP_PENALTIES,
) -> HeadMapFit:
    """Fit M by ridge least squares on the `fit` rows at each of `penalties` (in units of the
    served coordinates' variance), keep the one whose map, cut to `rank` directions and served
    with the constant its fit predicts (W (error_mean - M_r served_mean)), has the lowest mean
    KL on the `selection` rows. `basis`: the output head's weights W [V, d], shared by both
    models. ValueError for a bad rank or penalty, or rows with a masked token."""
    if not 1 <= rank <= basis.shape[1]:
        raise ValueError(f"rank must be in 1..{basis.shape[1]} (the head's width), got {rank}")
    if not penalties or min(penalties) <= 0:
        raise ValueError(f"penalties must be a non-empty list of values > 0, got {penalties}")
    _check_unmasked(fit, "fit")
    _check_unmasked(selection, "selection")
    head = basis.double()
    coordinates = head_coordinates(head)
    regression = _Regression.of(fit, coordinates)
    scores: dict[float, float] = {}
    best: tuple[float, HeadMap] | None = None
    for penalty in sorted(penalties):
        outer, inner = _truncated(regression.matrix(penalty), rank)
        head_map = HeadMap(left=(head @ outer).float(), right=(inner @ coordinates).float())
        constant = regression.error_mean - outer @ (inner @ regression.served_mean)
        shift = (head @ constant).float()
        with_shift = LogitBias(bias=shift - shift.mean(), temperature=1.0)
        kl = float(evaluate_bias(head_map.mapped(selection), with_shift).kl.mean())
        scores[penalty] = kl
        if best is None or kl < scores[best[0]]:
            best = (penalty, head_map)
    assert best is not None
    return HeadMapFit(head_map=best[1], penalty=best[0], selection_kl=scores)
