"""How good a per-token bias is on calibration data: paired rows from the scorer and the
bias's quality against the temperature rules on the same rows.

The temperature rules are fitted on stored KL curves (`PositionRecords`); a bias cannot be, it
needs the full served and clean rows (`PairedRows`), so `score_with_rows` keeps them next to
the records from the same forward passes. Rows take 8 bytes per vocabulary entry per position
(about 400 KB for a 49k vocabulary): `max_rows` bounds them by keeping an evenly spaced subset
of each sequence's positions when a set would exceed it. `bias_quality` measures a bias (with
its T, per request-temperature band) against a rule's temperatures and the oracle on the same
rows (`BiasQuality`); the fit itself is `calibration.bias_fit`'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.calibration.fitting import finite_positions
from noisy_temp_server.calibration.profile import QualityRow
from noisy_temp_server.calibration.quality import quality_row
from noisy_temp_server.calibration.significance import (
    SIGNIFICANCE_STDERRS,
    InsufficientDataError,
)
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows, evaluate_bias
from noisy_temp_server.correction.request_bands import (
    BandedBias,
    at_request_temperature,
)
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.temperature.oracle import oracle_temperature
from noisy_temp_server.temperature.stats import KLTerms

__all__ = [
    "BIAS_ROW_NAME",
    "BiasQuality",
    "ScoredSet",
    "bias_quality",
    "kl_at_temperatures",
    "score_with_rows",
]

BIAS_ROW_NAME = "bias"
"""The quality-table row of the bias + T correction."""


@dataclass(frozen=True)
class ScoredSet:
    """Records of every scored position, the paired rows of (a subset of) them, and
    `row_records`: the records at request temperature 1 of the positions of `rows`, row for row
    (what a temperature rule reads there, to compare it with the bias on the same rows)."""

    records: PositionRecords
    rows: PairedRows
    row_records: PositionRecords


def score_with_rows(
    scorer: PairScorer,
    sequences: Sequence[ScoringSequence],
    *,
    request_temperatures: Sequence[float] = (1.0,),
    max_rows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ScoredSet:
    """Score `sequences` once: the records of every position (once per request temperature,
    as `PairScorer.score_sequence` gives them), and `PairedRows` (against the clean model at
    T = 1) of at most `max_rows` positions (each sequence keeps an evenly spaced share; None
    keeps all, 0 none). `progress(done, total)` is called after every 8th sequence and the
    last."""
    total = sum(len(s.token_ids) - s.prompt_length for s in sequences)
    if max_rows is None or total <= max_rows:
        keep_every = 1
    else:
        keep_every = math.ceil(total / max_rows) if max_rows > 0 else total + 1
    records: list[PositionRecords] = []
    rows: list[PairedRows] = []
    row_records: list[PositionRecords] = []
    for done, sequence in enumerate(sequences, start=1):
        if progress is not None and (done % 8 == 0 or done == len(sequences)):
            progress(done, len(sequences))
        for steps, clean, served in scorer.logit_chunks(sequence):
            chunk = {
                temperature: scorer.chunk_records(
                    steps, clean, served, sequence.sequence_id, request_temperature=temperature
                )
                for temperature in request_temperatures
            }
            records += chunk.values()
            kept = steps % keep_every == 0 if max_rows != 0 else torch.zeros_like(steps).bool()
            rows.append(PairedRows.from_logits(clean[kept], served[kept], sequence.sequence_id))
            at_one = (
                chunk[1.0]
                if 1.0 in chunk
                else scorer.chunk_records(steps, clean, served, sequence.sequence_id)
            )
            # PairedRows leaves out the rows whose KL is infinite, as finite_positions does
            row_records.append(finite_positions(at_one.select(kept.to(at_one.step.device))))
    if not rows:
        raise InsufficientDataError("no sequences to score")
    return ScoredSet(
        PositionRecords.concat(records),
        PairedRows.concat(rows),
        PositionRecords.concat(row_records),
    )


@dataclass(frozen=True)
class BiasQuality:
    """A correction measured on held-out rows, beside T = 1 and the per-row oracle T on the
    same rows: its quality row (named `BIAS_ROW_NAME`), the T = 1 and oracle rows, and the
    same-top rates (a bias can change the top token; a temperature cannot). `over_rule`: when
    the correction was measured against a temperature rule on the same rows, at every request
    temperature the rule was given for, the mean paired gain KL(rule) - KL(correction) and its
    clustered standard error where the correction is furthest behind (lowest gain + 2 s.e.),
    at request temperature `over_rule_request_temperature` (else both None)."""

    row: QualityRow
    t_one: QualityRow
    oracle: QualityRow
    same_top_rate: float
    same_top_rate_t_one: float
    positions: int
    sequences: int
    over_rule: tuple[float, float] | None = None
    over_rule_request_temperature: float | None = None

    @property
    def share_removed(self) -> float:
        """Share of KL(T = 1) the correction removes: gain / KL(T = 1)."""
        return self.row.gain / self.t_one.mean_kl if self.t_one.mean_kl > 0 else 0.0


def bias_quality(
    rows: PairedRows,
    correction: LogitBias,
    min_positions: int = 100,
    *,
    rule_temperatures: Mapping[float, Tensor] | None = None,
    band_temperatures: Mapping[float, float] | None = None,
) -> BiasQuality:
    """`correction` on held-out `rows`, paired with T = 1 and the per-row oracle T there, and
    with a temperature rule when `rule_temperatures` is given: per request temperature T_r,
    the rule's T at each row [N] there (`BiasQuality.over_rule`: the rule's softmax(z~/(T_r T))
    against the correction's softmax((z~ + b)/(T_r T_b)), both against softmax(z/T_r), exact
    KL; `at_request_temperature`), T_b being the correction's T at T_r in `band_temperatures`
    (`fit_band_temperatures`), else its own.

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
    over_rule, over_rule_at = None, None
    rule_temperatures = rule_temperatures or {}
    banded = BandedBias(
        correction,
        band_temperatures or dict.fromkeys(rule_temperatures, correction.temperature),
    )
    for request_temperature, temperatures in rule_temperatures.items():
        gain = _gain_over_rule(
            rows, banded.at(request_temperature), request_temperature, temperatures
        )
        if over_rule is None or _margin(gain) < _margin(over_rule):
            over_rule, over_rule_at = gain, request_temperature
    return BiasQuality(
        row=row(BIAS_ROW_NAME, kl=corrected.kl.cpu(), temperatures=ones * correction.temperature),
        t_one=row("T=1", kl=kl_one, temperatures=ones),
        oracle=row("oracle", kl=oracle_kl, temperatures=oracle_t),
        same_top_rate=float(corrected.same_top.double().mean()),
        same_top_rate_t_one=float(one.same_top.double().mean()),
        positions=len(rows),
        sequences=int(torch.unique(ids).numel()),
        over_rule=over_rule,
        over_rule_request_temperature=over_rule_at,
    )


def _gain_over_rule(
    rows: PairedRows,
    correction: LogitBias,
    request_temperature: float,
    temperatures: Tensor,
) -> tuple[float, float]:
    """Mean paired gain KL(rule) - KL(correction) at `request_temperature` and its standard
    error clustered by sequence, the rule serving `temperatures` [N] on `rows` and
    `correction` being the one taken there (`BandedBias.at`)."""
    at_t_r = at_request_temperature(rows, request_temperature)
    kl_correction = evaluate_bias(at_t_r, correction).kl.double().cpu()
    gain = kl_at_temperatures(at_t_r, temperatures) - kl_correction
    return float(gain.mean()), cluster_stderr(gain, rows.sequence_id.cpu())


def _margin(gain_and_stderr: tuple[float, float]) -> float:
    gain, stderr = gain_and_stderr
    return gain + SIGNIFICANCE_STDERRS * stderr


def kl_at_temperatures(rows: PairedRows, temperatures: Tensor) -> Tensor:
    """Exact per-row KL(p || softmax(z~ / T_i)) of `rows` at their own `temperatures` [N]
    (> 0) -> float64 [N] on the CPU (clean log-probabilities are valid clean logits)."""
    kls = []
    for chunk in rows.chunks():
        terms = KLTerms.from_clean_prob(
            rows.clean_prob[chunk], rows.neg_entropy[chunk], rows.served_shifted[chunk]
        )
        u = temperatures[chunk].to(rows.served_shifted.device).reciprocal()
        kls.append(terms.kl(u).double().cpu())
    return torch.cat(kls) if kls else torch.zeros(0, dtype=torch.float64)


def _oracle(rows: PairedRows) -> tuple[Tensor, Tensor]:
    """Per-row oracle T and its KL on `rows` (clean log-probabilities are valid clean logits)."""
    temperatures, kls = [], []
    for chunk in rows.chunks():
        result = oracle_temperature(rows.clean_prob[chunk].log(), rows.served_shifted[chunk])
        temperatures.append(result.temperature.double().cpu())
        kls.append(result.kl.double().cpu())
    return torch.cat(temperatures), torch.cat(kls)
