"""The per-token logit bias on calibration data: paired rows from the scorer, the fit with its
penalty chosen on validation prompts, and its held-out quality row.

The temperature rules are fitted on stored KL curves (`PositionRecords`); a bias cannot be, it
needs the full served and clean rows (`PairedRows`), so `score_with_rows` keeps them next to
the records from the same forward passes. Rows take 8 bytes per vocabulary entry per position
(about 400 KB for a 49k vocabulary): `max_rows` bounds them by keeping an evenly spaced subset
of each sequence's positions when a set would exceed it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.estimation.profile import QualityRow
from noisy_temp_server.estimation.quality import quality_row
from noisy_temp_server.estimation.significance import (
    InsufficientDataError,
    split_by_sequence,
)
from noisy_temp_server.pairs.scorer import PairScorer, PositionRecords, ScoringSequence
from noisy_temp_server.temperature.bias import (
    DEFAULT_PENALTIES,
    BiasPath,
    LogitBias,
    PairedRows,
    evaluate_bias,
    fit_bias_at_penalty,
    fit_logit_bias,
)
from noisy_temp_server.temperature.oracle import oracle_temperature
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = [
    "BIAS_ROW_NAME",
    "BiasQuality",
    "ScoredSet",
    "bias_quality",
    "fit_bias_on_rows",
    "score_with_rows",
]

BIAS_ROW_NAME = "bias"
"""The quality-table row of the bias + T correction."""


@dataclass(frozen=True)
class ScoredSet:
    """Records of every scored position, and the paired rows of (a subset of) them."""

    records: PositionRecords
    rows: PairedRows


def score_with_rows(
    scorer: PairScorer, sequences: Sequence[ScoringSequence], *, max_rows: int | None = None
) -> ScoredSet:
    """Score `sequences` once: the records of every position, and `PairedRows` of at most
    `max_rows` positions (each sequence keeps an evenly spaced share; None keeps all)."""
    total = sum(len(s.token_ids) - s.prompt_length for s in sequences)
    keep_every = 1 if max_rows is None or total <= max_rows else math.ceil(total / max_rows)
    records, rows = [], []
    for sequence in sequences:
        for steps, clean, served in scorer.logit_chunks(sequence):
            records.append(
                PositionRecords.from_logits(
                    clean,
                    served,
                    step=steps,
                    sequence_id=sequence.sequence_id,
                    curve_temperatures=scorer.curve_temperatures.to(clean.device),
                )
            )
            kept = steps % keep_every == 0
            rows.append(PairedRows.from_logits(clean[kept], served[kept], sequence.sequence_id))
    if not rows:
        raise InsufficientDataError("no sequences to score")
    return ScoredSet(PositionRecords.concat(records), PairedRows.concat(rows))


def fit_bias_on_rows(
    rows: PairedRows,
    *,
    validation_fraction: float = 0.5,
    seed: int = 0,
    penalties: Sequence[float] = DEFAULT_PENALTIES,
    bounds: TemperatureBounds | None = None,
) -> BiasPath:
    """Split `rows` by sequence into train and validation (`validation_fraction` of the
    sequences), choose the penalty on validation (`fit_logit_bias`), then refit on all of
    `rows` at the chosen penalty, warm-started from the chosen fit.

    Raises `InsufficientDataError` with fewer than two sequences.
    """
    train_mask, validation_mask = split_by_sequence(rows.sequence_id, validation_fraction, seed)
    path = fit_logit_bias(
        rows.select(train_mask),
        rows.select(validation_mask),
        penalties=penalties,
        bounds=bounds,
    )
    chosen = path.chosen
    refit = fit_bias_at_penalty(
        rows,
        chosen.penalty,
        bounds=bounds,
        start=chosen.correction,
        fit_bias=math.isfinite(chosen.penalty),
    )
    return BiasPath(chosen=refit, validation_kl=path.validation_kl)


@dataclass(frozen=True)
class BiasQuality:
    """A correction measured on held-out rows, beside T = 1 and the per-row oracle T on the
    same rows: its quality row (named `BIAS_ROW_NAME`), the T = 1 and oracle rows, and the
    same-top rates (a bias can change the top token; a temperature cannot)."""

    row: QualityRow
    t_one: QualityRow
    oracle: QualityRow
    same_top_rate: float
    same_top_rate_t_one: float
    positions: int
    sequences: int

    @property
    def share_removed(self) -> float:
        """Share of KL(T = 1) the correction removes: gain / KL(T = 1)."""
        return self.row.gain / self.t_one.mean_kl if self.t_one.mean_kl > 0 else 0.0


def bias_quality(rows: PairedRows, correction: LogitBias, min_positions: int = 100) -> BiasQuality:
    """`correction` on held-out `rows`, paired with T = 1 and the per-row oracle T there.

    Raises `InsufficientDataError` below `min_positions` rows.
    """
    if len(rows) < min_positions:
        raise InsufficientDataError(
            f"only {len(rows)} held-out rows; the bias quality row needs at least {min_positions}"
        )
    ids = rows.sequence_id.cpu()
    corrected = evaluate_bias(rows, correction)
    one = evaluate_bias(rows, LogitBias.identity(rows.vocab_size, rows.served_shifted.device))
    kl_one = one.kl.double().cpu()
    oracle_t, oracle_kl = _oracle(rows)
    row = functools.partial(
        quality_row,
        sequence_ids=ids,
        kl_at_one=kl_one,
        kl_one=float(kl_one.mean()),
        kl_oracle=float(oracle_kl.mean()),
        kl_fixed=None,
    )
    ones = torch.ones(len(rows), dtype=torch.float64)
    return BiasQuality(
        row=row(BIAS_ROW_NAME, kl=corrected.kl.cpu(), temperatures=ones * correction.temperature),
        t_one=row("T=1", kl=kl_one, temperatures=ones),
        oracle=row("oracle", kl=oracle_kl, temperatures=oracle_t),
        same_top_rate=float(corrected.same_top.double().mean()),
        same_top_rate_t_one=float(one.same_top.double().mean()),
        positions=len(rows),
        sequences=int(torch.unique(ids).numel()),
    )


def _oracle(rows: PairedRows) -> tuple[Tensor, Tensor]:
    """Per-row oracle T and its KL on `rows` (clean log-probabilities are valid clean logits)."""
    temperatures, kls = [], []
    for chunk in rows.chunks():
        result = oracle_temperature(rows.clean_prob[chunk].log(), rows.served_shifted[chunk])
        temperatures.append(result.temperature.double().cpu())
        kls.append(result.kl.double().cpu())
    return torch.cat(temperatures), torch.cat(kls)
