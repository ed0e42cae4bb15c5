"""The KL scoreboard: llama.cpp's KL-divergence statistics of a clean/served pair, streamed.

From per-position clean and served logits (a chunk at a time; no logits are kept) and the token
that followed each position, `ScoreAccumulator` accumulates, for the served distribution
q = softmax(served / T) at a per-position temperature T against p = softmax(clean):

- KLD = KL(p || q): mean with its standard error, and the 99.9, 99, 90, 50, 10, 5 and 1 %
  percentiles;
- the same-top-token rate (argmax p == argmax q) with its binomial standard error
  sqrt(r (1 - r) / N);
- Δp = q(top) - p(top) of the clean model's top token: mean with its standard error,
  percentiles and RMS;
- the perplexity ratio PPL(served) / PPL(clean) over the scored tokens x:
  ln ratio = mean over positions of (ln p(x) - ln q(x)), with its standard error.

Standard errors of means are cluster-robust by sequence (prompt): the positions of one
completion are correlated, so treating them as independent would understate the uncertainty.
`scoring.standard_error` computes them from per-sequence sums (as the calibration quality table
does from positions).

Memory is bounded: means and standard errors need only per-sequence sums (a few floats per
sequence); percentiles are exact while at most `capacity` positions have been seen and
otherwise come from a uniform sample of `capacity` positions (bottom-k by a hash of
(sequence id, step), so merging two accumulators gives exactly the accumulator of the union).
Positions with a non-finite KLD or log-ratio (the served row masks a token the clean row
supports) are counted in `infinite_positions` and left out of every statistic.

`PairScoreboard` runs two accumulators side by side: T = 1 and T* of a served policy
(`policy_temperature`, the one implementation of rule -> T). When the policy serves a per-token
logit bias b, its "T*" column scores what is served, q = softmax((z~ + b) / T*)
(`corrected_rows`), as the engine adds b before the temperature.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from noisy_temp_server.correction.files import bias_sha256, check_bias_vocabulary
from noisy_temp_server.scoring.position_scores import (
    PositionScores,
    corrected_rows,
    scores_as_served,
)
from noisy_temp_server.scoring.standard_error import cluster_stderr_of_sums
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.stats import PairTerms

__all__ = [
    "MIN_SCOREBOARD_POSITIONS",
    "SCOREBOARD_PERCENTILES",
    "LiveScoreboard",
    "PairScoreboard",
    "ScoreAccumulator",
    "ScoreboardResult",
    "TooFewPositionsError",
    "paired_kld_gain",
]

SCOREBOARD_PERCENTILES: tuple[float, ...] = (99.9, 99.0, 90.0, 50.0, 10.0, 5.0, 1.0)
MIN_SCOREBOARD_POSITIONS = 100
"""Fewest finite positions a result is given for (the calibration quality table's minimum)."""
DEFAULT_CAPACITY = 1 << 18

# Columns of the per-sequence sums.
_COUNT, _KLD, _SAME, _DP, _DP2, _LOG_RATIO = range(6)
_COLUMNS = 6
_MASK32 = 0xFFFFFFFF


class TooFewPositionsError(ValueError):
    """Fewer than `MIN_SCOREBOARD_POSITIONS` finite positions to report on."""


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (products stay below 2^59)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _sample_keys(sequence_id: Tensor, step: Tensor) -> Tensor:
    """A 62-bit pseudo-random int64 key per (sequence id, step), the same wherever computed."""
    seq, st = sequence_id & _MASK32, step & _MASK32
    high = _mix32(_mix32(seq) ^ st) >> 1
    low = _mix32(_mix32(st ^ 0x9E3779B9) ^ seq) >> 1
    return (high << 31) | low


def _percentiles(values: Tensor) -> dict[str, float]:
    levels = torch.tensor(SCOREBOARD_PERCENTILES, dtype=torch.float64) / 100
    quantiles = torch.quantile(values.double(), levels).tolist()
    return {f"{level:g}": q for level, q in zip(SCOREBOARD_PERCENTILES, quantiles, strict=True)}


@dataclass(frozen=True)
class ScoreboardResult:
    """The statistics of the module docstring; percentiles are keyed by level ("99.9", ...)."""

    positions: int
    sequences: int
    infinite_positions: int
    exact_percentiles: bool
    kld_mean: float
    kld_stderr: float
    kld_percentiles: dict[str, float]
    same_top_rate: float
    same_top_stderr: float
    delta_p_mean: float
    delta_p_stderr: float
    delta_p_rms: float
    delta_p_percentiles: dict[str, float]
    ln_ppl_ratio: float
    ln_ppl_ratio_stderr: float
    ppl_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScoreAccumulator:
    """Streaming, mergeable accumulator of `PositionScores` (see the module docstring).

    `update(scores)` adds a chunk, `merge(other)` adds another accumulator's positions (the
    two must not share a (sequence id, step) position), `result()` gives the statistics.
    Memory: `capacity` sampled positions (4 scalars each) plus 6 floats per sequence.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < MIN_SCOREBOARD_POSITIONS:
            raise ValueError(f"capacity must be >= {MIN_SCOREBOARD_POSITIONS}, got {capacity}")
        self.capacity = capacity
        self.seen = 0
        self.infinite_positions = 0
        self._cluster_ids = torch.zeros(0, dtype=torch.int64)
        self._cluster_sums = torch.zeros(0, _COLUMNS, dtype=torch.float64)
        self._keys = torch.zeros(0, dtype=torch.int64)
        self._sample = torch.zeros(0, 2, dtype=torch.float64)  # (kld, delta_p) per position

    def update(self, scores: PositionScores) -> None:
        """Add the positions of one chunk."""
        finite = torch.isfinite(scores.kld) & torch.isfinite(scores.log_ratio)
        self.infinite_positions += int((~finite).sum())
        if not bool(finite.any()):
            return
        ids = scores.sequence_id[finite]
        delta_p = scores.delta_p[finite]
        columns = torch.stack(
            [
                torch.ones_like(delta_p),
                scores.kld[finite],
                scores.same_top[finite].double(),
                delta_p,
                delta_p.square(),
                scores.log_ratio[finite],
            ],
            dim=1,
        )
        cluster_ids, inverse = torch.unique(ids, return_inverse=True)
        sums = torch.zeros(cluster_ids.shape[0], _COLUMNS, dtype=torch.float64)
        sums.index_add_(0, inverse, columns)
        self._add_clusters(cluster_ids, sums)
        keys = _sample_keys(ids, scores.step[finite])
        self._add_sample(keys, torch.stack([columns[:, _KLD], delta_p], dim=1))
        self.seen += int(finite.sum())

    def merge(self, other: ScoreAccumulator) -> None:
        """Add `other`'s positions to this accumulator (`other` is not modified)."""
        self._add_clusters(other._cluster_ids, other._cluster_sums)
        self._add_sample(other._keys, other._sample)
        self.seen += other.seen
        self.infinite_positions += other.infinite_positions

    def _add_clusters(self, ids: Tensor, sums: Tensor) -> None:
        all_ids = torch.cat([self._cluster_ids, ids])
        merged_ids, inverse = torch.unique(all_ids, return_inverse=True)
        merged = torch.zeros(merged_ids.shape[0], _COLUMNS, dtype=torch.float64)
        merged.index_add_(0, inverse, torch.cat([self._cluster_sums, sums]))
        self._cluster_ids, self._cluster_sums = merged_ids, merged

    def _add_sample(self, keys: Tensor, values: Tensor) -> None:
        keys = torch.cat([self._keys, keys])
        values = torch.cat([self._sample, values])
        if keys.shape[0] > self.capacity:
            kept = torch.topk(keys, self.capacity, largest=False).indices
            keys, values = keys[kept], values[kept]
        self._keys, self._sample = keys, values

    def result(self) -> ScoreboardResult:
        """The statistics; `TooFewPositionsError` below `MIN_SCOREBOARD_POSITIONS` positions."""
        if self.seen < MIN_SCOREBOARD_POSITIONS:
            raise TooFewPositionsError(
                f"only {self.seen} scored positions with finite KL; the scoreboard needs at "
                f"least {MIN_SCOREBOARD_POSITIONS}: use more prompts or longer completions"
            )
        sums, counts = self._cluster_sums, self._cluster_sums[:, _COUNT]
        total = float(counts.sum())

        def mean_and_stderr(column: int) -> tuple[float, float]:
            mean = float(sums[:, column].sum()) / total
            return mean, cluster_stderr_of_sums(sums[:, column], counts, mean)

        kld_mean, kld_stderr = mean_and_stderr(_KLD)
        dp_mean, dp_stderr = mean_and_stderr(_DP)
        log_ratio, log_ratio_stderr = mean_and_stderr(_LOG_RATIO)
        same = float(sums[:, _SAME].sum()) / total
        return ScoreboardResult(
            positions=self.seen,
            sequences=int(sums.shape[0]),
            infinite_positions=self.infinite_positions,
            exact_percentiles=self.seen <= self.capacity,
            kld_mean=kld_mean,
            kld_stderr=kld_stderr,
            kld_percentiles=_percentiles(self._sample[:, 0]),
            same_top_rate=same,
            same_top_stderr=math.sqrt(same * (1 - same) / total),
            delta_p_mean=dp_mean,
            delta_p_stderr=dp_stderr,
            delta_p_rms=math.sqrt(float(sums[:, _DP2].sum()) / total),
            delta_p_percentiles=_percentiles(self._sample[:, 1]),
            ln_ppl_ratio=log_ratio,
            ln_ppl_ratio_stderr=log_ratio_stderr,
            ppl_ratio=math.exp(log_ratio),
        )


def paired_kld_gain(reference: ScoreAccumulator, other: ScoreAccumulator) -> tuple[float, float]:
    """Mean KLD(reference) - KLD(other) over the same positions, with its cluster-robust
    standard error (the paired difference: per-sequence sums subtract). ValueError unless both
    accumulated the same sequences with the same numbers of finite positions."""
    ids, sums = reference._cluster_ids, reference._cluster_sums
    if not torch.equal(ids, other._cluster_ids) or not torch.equal(
        sums[:, _COUNT], other._cluster_sums[:, _COUNT]
    ):
        raise ValueError("a paired gain needs the same positions in both accumulators")
    counts = sums[:, _COUNT]
    total = float(counts.sum())
    if total == 0:
        raise ValueError("a paired gain needs positions")
    difference = sums[:, _KLD] - other._cluster_sums[:, _KLD]
    mean = float(difference.sum()) / total
    return mean, cluster_stderr_of_sums(difference, counts, mean)


def _check_bias(named: str | None, given: Tensor | None) -> None:
    """ValueError unless the bias vector `given` is there exactly when the policy names one
    (`named`, its sha256) and is the one it names."""
    what = "per-token bias vector"
    if (named is None) != (given is None):
        raise ValueError(
            f"the policy names a {what}: give it"
            if given is None
            else f"a {what} was given for a policy without one"
        )
    if given is not None and bias_sha256(given) != named:
        raise ValueError(f"the {what} is not the policy's ({named})")


class PairScoreboard:
    """Two accumulators over the same positions: the served model at T = 1 ("T=1") and as
    `policy` serves it ("T*"): softmax((z~ + b) / T*), each position's T* from its step and
    corrected row z~ + b (`corrected_rows`), b the policy's per-token bias (`bias`: the float
    [V] vector, required exactly when the policy names one, and checked against the policy's
    hash; without, b = 0)."""

    LABELS = ("T=1", "T*")

    def __init__(
        self,
        policy: TemperaturePolicy,
        capacity: int = DEFAULT_CAPACITY,
        *,
        bias: Tensor | None = None,
    ) -> None:
        _check_bias(policy.bias, bias)
        self.policy = policy
        self.bias = bias
        self.accumulators = {label: ScoreAccumulator(capacity) for label in self.LABELS}
        self.temperature_sum = 0.0

    def update(
        self,
        clean: Tensor,
        served: Tensor,
        next_tokens: Tensor,
        *,
        step: Tensor,
        sequence_id: int | Tensor,
    ) -> None:
        """Score one chunk of `[B, V]` logits (served: z~, before the bias and the temperature;
        ValueError when the policy's bias does not fit their vocabulary)."""
        terms = PairTerms.from_logits(clean, served)
        biased = None
        if self.bias is not None:
            check_bias_vocabulary(self.bias, served.shape[-1], "the served model")
            served = corrected_rows(served, self.bias)
            biased = PairTerms.from_logits(clean, served)
        t_star = policy_temperature(self.policy, step.to(served.device), served)
        both = scores_as_served(
            terms, next_tokens, t_star, biased=biased, sequence_id=sequence_id, step=step
        )
        for label, chunk in zip(self.LABELS, both, strict=True):
            self.accumulators[label].update(chunk)
        self.temperature_sum += float(t_star.double().sum())

    def merge(self, other: PairScoreboard) -> None:
        """Add `other`'s positions (same policy expected; not checked beyond the labels)."""
        for label in self.LABELS:
            self.accumulators[label].merge(other.accumulators[label])
        self.temperature_sum += other.temperature_sum

    def mean_temperature(self) -> float:
        """Mean T* over all scored positions (finite or not); NaN before any."""
        accumulator = self.accumulators["T*"]
        count = accumulator.seen + accumulator.infinite_positions
        return self.temperature_sum / count if count else math.nan

    def result(self) -> dict[str, ScoreboardResult]:
        """Results by label; `TooFewPositionsError` below the minimum number of positions."""
        return {label: acc.result() for label, acc in self.accumulators.items()}


class LiveScoreboard:
    """The scoreboard of recent live traffic: T = 1 ("T=1") and the T* the engine applied
    ("T*"), over a rolling window.

    Each label keeps two accumulators, the current epoch and the previous one; when the
    current one has seen `epoch_positions` positions it becomes the previous one (the older
    is dropped). `result()` merges the two, so it covers between `epoch_positions` and twice
    that many of the most recent positions (all of them before the first rollover). Memory is
    bounded by the epochs: `capacity` sampled positions and one row of sums per sequence.
    Not thread-safe: one thread updates, and publishes `result()` snapshots.
    """

    LABELS = PairScoreboard.LABELS

    def __init__(self, epoch_positions: int = 10_000, capacity: int = 1 << 14) -> None:
        if epoch_positions < MIN_SCOREBOARD_POSITIONS:
            raise ValueError(
                f"epoch_positions must be >= {MIN_SCOREBOARD_POSITIONS}, got {epoch_positions}"
            )
        self.epoch_positions = epoch_positions
        self.capacity = capacity
        self._epochs = {label: [ScoreAccumulator(capacity)] for label in self.LABELS}

    def update(self, at_one: PositionScores, at_served: PositionScores) -> None:
        """Add one request's scores at T = 1 and at the served T*."""
        for label, scores in zip(self.LABELS, (at_one, at_served), strict=True):
            epochs = self._epochs[label]
            epochs[-1].update(scores)
            if epochs[-1].seen >= self.epoch_positions:
                self._epochs[label] = [epochs[-1], ScoreAccumulator(self.capacity)]

    def result(self) -> dict[str, dict[str, Any]]:
        """By label: `ScoreboardResult.to_dict()` with JSON's null for a non-finite value (a
        standard error is infinite while the window holds one request), or
        `{"positions": n, "error": why}` below `MIN_SCOREBOARD_POSITIONS` finite positions."""
        results: dict[str, dict[str, Any]] = {}
        for label, epochs in self._epochs.items():
            window = ScoreAccumulator(self.capacity)
            for epoch in epochs:
                window.merge(epoch)
            try:
                result = window.result().to_dict()
            except TooFewPositionsError as error:
                results[label] = {"positions": window.seen, "error": str(error)}
                continue
            results[label] = {
                name: None if isinstance(value, float) and not math.isfinite(value) else value
                for name, value in result.items()
            }
        return results
