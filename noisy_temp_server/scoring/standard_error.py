"""The standard error of a mean over positions, cluster-robust by sequence (prompt).

The positions of one completion are correlated, so treating them as independent would
understate the uncertainty. With G sequences, N positions, per-sequence sums S_g over n_g
positions and mean m: SE^2 = G / (G - 1) * sum_g (S_g - n_g m)^2 / N^2.

It lives with the pair's measurements (torch only) so that the scoreboard here and the
calibration and online fits above share one implementation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["cluster_stderr", "cluster_stderr_of_sums"]


def cluster_stderr_of_sums(sums: Tensor, counts: Tensor, mean: float) -> float:
    """The clustered standard error of `mean` from per-cluster `sums` [G] and position
    `counts` [G] (float64); inf with fewer than two clusters or no position."""
    clusters = sums.shape[0]
    total = float(counts.sum())
    if clusters < 2 or total == 0:
        return math.inf
    residual = sums - counts * mean
    return math.sqrt(clusters / (clusters - 1) * float(residual.square().sum())) / total


def cluster_stderr(values: Tensor, sequence_ids: Tensor) -> float:
    """The clustered standard error of the mean of `values` [N] (one per position), clustered
    by `sequence_ids` [N]; inf with fewer than two positions or sequences."""
    if values.shape[0] < 2:
        return math.inf
    centred = values.double() - values.double().mean()  # summed centred: mean 0, exact sums
    _, cluster = torch.unique(sequence_ids, return_inverse=True)
    clusters = int(cluster.max()) + 1
    sums = torch.zeros(clusters, dtype=torch.float64).index_add_(0, cluster, centred)
    counts = torch.zeros(clusters, dtype=torch.float64).index_add_(
        0, cluster, torch.ones_like(centred)
    )
    return cluster_stderr_of_sums(sums, counts, 0.0)
