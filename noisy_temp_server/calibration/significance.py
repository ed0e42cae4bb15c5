"""How much evidence there is: prompt-level splits, cluster-robust standard errors, significance.

Positions of one completion are correlated, so treating them as independent would overstate the
evidence: standard errors of means over positions are cluster-robust by sequence (prompt,
`scoring.standard_error.cluster_stderr`), and sets are split by sequence, never by position. A
mean gain is significant when it exceeds `SIGNIFICANCE_STDERRS` (2) standard errors; a mean loss
is within noise when it is smaller than that many standard errors.

A gain measured on KL read off the records' KL curves (every rule but T = 1 and the oracle) also
carries the curves' interpolation error, which near a minimum has a consistent sign: a standard
error does not shrink it, more data only makes it look more significant. `is_material_gain`
adds a practical floor for those gates, `MIN_RELATIVE_GAIN` of the reference KL.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "MIN_RELATIVE_GAIN",
    "SIGNIFICANCE_STDERRS",
    "InsufficientDataError",
    "is_material_gain",
    "is_not_worse",
    "is_significant",
    "split_by_sequence",
    "split_fit_validation_test",
    "split_selection_gate",
]

SIGNIFICANCE_STDERRS = 2.0
"""A gain is significant when its mean minus this many standard errors is > 0."""


MIN_RELATIVE_GAIN = 1e-3
"""Smallest mean gain, as a share of the reference's mean KL, that a gate on interpolated KL
accepts. Sized to the interpolation error of the curves (cubic Hermite in log T on
`KL_CURVE_TEMPERATURES`): on synthetic rows (logits of scale 0.5-4.5, noise 0.2-1.5) whose
every optimum is one known T, the best T read off the pooled curves looks better than that
optimum by at most 2.2e-5 of its KL, and the signed error of the mean curve is at most 2.2e-3
of the KL anywhere in T in [0.7, 1.4]. Real gains the gates are for are per cent of the KL; the
online bias uses the same floor for the same
reason (its `min_relative_gain`)."""


class InsufficientDataError(ValueError):
    """Too few positions (or sequences) to fit or to report on."""


def split_by_sequence(sequence_ids: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Split the distinct ids of `sequence_ids` [N] into two disjoint sets.

    Returns bool masks over the N rows: (first, second), the second holding about `fraction`
    of the sequences (at least one, and at least one left for the first). Deterministic in
    `seed`. Raises `InsufficientDataError` with fewer than two sequences.
    """
    ids = torch.unique(sequence_ids)
    if ids.numel() < 2:
        raise InsufficientDataError(
            f"need at least 2 sequences to split, got {ids.numel()}; use more prompts"
        )
    order = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))
    count = min(ids.numel() - 1, max(1, round(fraction * ids.numel())))
    second_ids = ids[order[:count]]
    second = torch.isin(sequence_ids, second_ids)
    return ~second, second


def split_fit_validation_test(
    sequence_ids: Tensor, validation_fraction: float, test_fraction: float, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Split the distinct ids of `sequence_ids` [N] into three disjoint sets of sequences.

    Returns bool masks over the N rows: (fit, validation, test), with about `test_fraction`
    and `validation_fraction` of the sequences in the last two and at least one sequence in
    each. Deterministic in `seed`. Raises `InsufficientDataError` with fewer than three
    sequences.
    """
    if torch.unique(sequence_ids).numel() < 3:
        raise InsufficientDataError(
            "need at least 3 sequences to split into fit, validation and test; use more prompts"
        )
    rest, test = split_by_sequence(sequence_ids, test_fraction, seed)
    rest_ids = sequence_ids[rest]
    _, validation_part = split_by_sequence(
        rest_ids, validation_fraction / (1.0 - test_fraction), seed + 1
    )
    validation = torch.zeros_like(rest)
    validation[rest.nonzero().squeeze(1)] = validation_part
    return rest & ~validation, validation, test


def split_selection_gate(sequence_ids: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """Split the validation split's `sequence_ids` [N] into halves: (selection, gate) bool masks.

    Calibration makes its choices from data (the calibrated table's cells, the bias's
    penalties) on the selection half and gates the recommendation (beats T = 1, the bias not
    behind the rule) on the gate half: a choice made on the same rows as its gate would be
    favoured by their noise (the winner's curse). Deterministic in `seed` and in the set of ids,
    so the records and the bias rows of one calibration split alike. Raises
    `InsufficientDataError` with fewer than two sequences.
    """
    if torch.unique(sequence_ids).numel() < 2:
        raise InsufficientDataError(
            "the validation split needs at least 2 prompts (a selection and a gate half); use "
            "more prompts or a larger validation_fraction"
        )
    return split_by_sequence(sequence_ids, 0.5, seed + 2)


def is_significant(gain: float, stderr: float) -> bool:
    """Whether a mean gain with this standard error is significant (see `SIGNIFICANCE_STDERRS`)."""
    return gain - SIGNIFICANCE_STDERRS * stderr > 0


def is_material_gain(
    gain: float, stderr: float, reference_kl: float, min_relative_gain: float = MIN_RELATIVE_GAIN
) -> bool:
    """Whether a mean gain over a reference with mean KL `reference_kl` is significant
    (`is_significant`) and exceeds `min_relative_gain` of that KL (see `MIN_RELATIVE_GAIN`)."""
    return is_significant(gain, stderr) and gain > min_relative_gain * reference_kl


def is_not_worse(gain: float, stderr: float) -> bool:
    """Whether a mean gain with this standard error is not significantly negative: gain plus
    `SIGNIFICANCE_STDERRS` standard errors >= 0 (a loss within the noise of the estimate)."""
    return gain + SIGNIFICANCE_STDERRS * stderr >= 0
