"""How much evidence there is: prompt-level splits, cluster-robust standard errors, significance.

Positions of one completion are correlated, so treating them as independent would overstate the
evidence: standard errors of means over positions are cluster-robust by sequence (prompt), and
sets are split by sequence, never by position. A mean gain is significant when it exceeds
`SIGNIFICANCE_STDERRS` (2) standard errors; a mean loss is within noise when it is smaller than
that many standard errors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "SIGNIFICANCE_STDERRS",
    "InsufficientDataError",
    "cluster_stderr",
    "is_not_worse",
    "is_significant",
    "split_by_sequence",
    "split_fit_validation_test",
]

SIGNIFICANCE_STDERRS = 2.0
"""A gain is significant when its mean minus this many standard errors is > 0."""


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


def cluster_stderr(values: Tensor, sequence_ids: Tensor) -> float:
    """Standard error of the mean of `values` [N], cluster-robust over `sequence_ids`."""
    count = values.shape[0]
    if count < 2:
        return math.inf
    centred = values.double() - values.double().mean()
    _, cluster = torch.unique(sequence_ids, return_inverse=True)
    sums = torch.zeros(int(cluster.max()) + 1, dtype=torch.float64).index_add_(0, cluster, centred)
    clusters = sums.shape[0]
    if clusters < 2:
        return math.inf
    correction = clusters / (clusters - 1)
    return math.sqrt(correction * float(sums.square().sum())) / count


def is_significant(gain: float, stderr: float) -> bool:
    """Whether a mean gain with this standard error is significant (see `SIGNIFICANCE_STDERRS`)."""
    return gain - SIGNIFICANCE_STDERRS * stderr > 0


def is_not_worse(gain: float, stderr: float) -> bool:
    """Whether a mean gain with this standard error is not significantly negative: gain plus
    `SIGNIFICANCE_STDERRS` standard errors >= 0 (a loss within the noise of the estimate)."""
    return gain + SIGNIFICANCE_STDERRS * stderr >= 0
