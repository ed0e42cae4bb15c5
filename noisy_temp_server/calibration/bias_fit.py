"""The per-token logit bias on calibration data: paired rows from the scorer, the fit with its
penalty chosen on the selection half of the validation prompts, and its quality rows on the
gate half (the recommendation) and on the test prompts.

The temperature rules are fitted on stored KL curves (`PositionRecords`); a bias cannot be, it
needs the full served and clean rows (`PairedRows`), so `score_with_rows` keeps them next to
the records from the same forward passes. Rows take 8 bytes per vocabulary entry per position
(about 400 KB for a 49k vocabulary): `max_rows` bounds them by keeping an evenly spaced subset
of each sequence's positions when a set would exceed it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from noisy_temp_server.calibration.fitting import finite_positions
from noisy_temp_server.calibration.fitting import rule_temperatures as rule_temperatures_of
from noisy_temp_server.calibration.profile import BiasSummary, CalibrationSettings, QualityRow
from noisy_temp_server.calibration.quality import quality_row
from noisy_temp_server.calibration.significance import (
    SIGNIFICANCE_STDERRS,
    InsufficientDataError,
    is_not_worse,
    is_significant,
    split_fit_validation_test,
    split_selection_gate,
)
from noisy_temp_server.correction.bias import (
    BiasFit,
    BiasPath,
    LogitBias,
    PairedRows,
    evaluate_bias,
    fit_bias_at_penalty,
    fit_logit_bias,
)
from noisy_temp_server.correction.files import bias_sha256, head_map_sha256
from noisy_temp_server.correction.head_map import HeadMapFit, fit_head_map
from noisy_temp_server.correction.request_bands import (
    BandedBias,
    at_request_temperature,
    best_temperature,
)
from noisy_temp_server.pairs.records import PositionRecords
from noisy_temp_server.pairs.scorer import PairScorer, ScoringSequence
from noisy_temp_server.pairs.standard_error import cluster_stderr
from noisy_temp_server.temperature.oracle import oracle_temperature
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds
from noisy_temp_server.temperature.stats import KLTerms

__all__ = [
    "BIAS_ROW_NAME",
    "BiasCalibration",
    "BiasQuality",
    "ScoredSet",
    "bias_quality",
    "calibrate_bias",
    "fit_band_temperatures",
    "fit_bias_for_serving",
    "kl_at_temperatures",
    "penalties_text",
    "rule_temperatures_by_request_temperature",
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
    unmapped: PairedRows | None = None,
) -> BiasQuality:
    """`correction` on held-out `rows`, paired with T = 1 and the per-row oracle T there, and
    with a temperature rule when `rule_temperatures` is given: per request temperature T_r,
    the rule's T at each row [N] there (`BiasQuality.over_rule`: the rule's softmax(z~/(T_r T))
    against the correction's softmax((z~ + b)/(T_r T_b)), both against softmax(z/T_r), exact
    KL; `at_request_temperature`), T_b being the correction's T at T_r in `band_temperatures`
    (`fit_band_temperatures`), else its own. When `rows` were mapped (`HeadMap.mapped`), the
    correction is the map and the bias together: `unmapped` are the same rows as served, where
    T = 1, the oracle and the rule are measured.

    Raises `InsufficientDataError` below `min_positions` rows.
    """
    if len(rows) < min_positions:
        raise InsufficientDataError(
            f"only {len(rows)} held-out rows; the bias quality row needs at least {min_positions}"
        )
    ids = rows.sequence_id.cpu()
    served = rows if unmapped is None else unmapped
    corrected = evaluate_bias(rows, correction)
    one = evaluate_bias(served, LogitBias.identity(rows.vocab_size, rows.served_shifted.device))
    kl_one = one.kl.double().cpu()
    oracle_t, oracle_kl = _oracle(served)
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
            rows, served, banded.at(request_temperature), request_temperature, temperatures
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
    served: PairedRows,
    correction: LogitBias,
    request_temperature: float,
    temperatures: Tensor,
) -> tuple[float, float]:
    """Mean paired gain KL(rule) - KL(correction) at `request_temperature` and its standard
    error clustered by sequence, the rule serving `temperatures` [N] on the `served` rows and
    `correction` being that of `rows` (the same, or mapped) taken there (`BandedBias.at`)."""
    kl_correction = (
        evaluate_bias(at_request_temperature(rows, request_temperature), correction)
        .kl.double()
        .cpu()
    )
    at_t_r = at_request_temperature(served, request_temperature)
    gain = kl_at_temperatures(at_t_r, temperatures) - kl_correction
    return float(gain.mean()), cluster_stderr(gain, rows.sequence_id.cpu())


def fit_band_temperatures(
    rows: PairedRows,
    correction: LogitBias,
    request_temperatures: Sequence[float],
    bounds: TemperatureBounds | None = None,
) -> dict[float, float]:
    """The T to serve `correction`'s bias with at each request temperature: at T_r = 1 its own
    (fitted jointly with the bias), elsewhere the T in `bounds` minimising the mean over `rows`
    of KL(softmax(z/T_r) || softmax((z~ + b)/(T_r T))) (`best_temperature` on the rows taken to
    T_r): the bias under the request-temperature bands a temperature rule has."""
    return {
        t_r: correction.temperature
        if t_r == 1.0
        else best_temperature(at_request_temperature(rows, t_r), correction.bias / t_r, bounds)
        for t_r in request_temperatures
    }


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


@dataclass(frozen=True)
class BiasCalibration:
    """The bias as calibration fits it (`calibrate_bias`): `path` holds the served fit (on the
    fit and validation prompts, at the penalties chosen on the validation prompts' selection
    half); `validation` measures the fit-prompts-only fit at those penalties on the gate half
    (the recommendation: rows that took no part in choosing them), `test` the served one;
    `fitted_rows`: the rows the served fit saw."""

    path: BiasPath
    validation: BiasQuality
    test: BiasQuality
    fitted_rows: int
    band_temperatures: Mapping[float, float]
    """The T served with the bias at each request temperature of the settings, in their order
    (`fit_band_temperatures`, on the rows the served fit saw)."""
    rule: Rule | None = None
    """The temperature rule `validation` compared the bias with (the profile's recommended
    rule), if any."""
    head_map: HeadMapFit | None = None
    """The head map the bias was fitted on top of (`calibrate_bias`'s `head_map_rank`), if any:
    the correction measured and served is the two together."""

    @property
    def correction(self) -> LogitBias:
        return self.path.chosen.correction

    @property
    def recommended(self) -> bool:
        """Whether a bias won on the selection half (not the T-only fit), its gain over T = 1
        on the gate half is significant (gain - 2 s.e. > 0), and, when it was measured
        against the recommended temperature rule there (`BiasQuality.over_rule`), it is not
        significantly worse than that rule (gain + 2 s.e. >= 0): served, it replaces it."""
        return not self.unmet_conditions()

    def unmet_conditions(self) -> list[str]:
        """Which conditions of `recommended` fail, in words (none: it is recommended)."""
        if not self.path.chosen.has_bias:
            return ["the T-only fit won on the selection half"]
        row, over_rule = self.validation.row, self.validation.over_rule
        unmet = []
        if not is_significant(row.gain, row.gain_stderr):
            unmet.append(
                f"its gain over T = 1 on the gate half, {1e3 * row.gain:+.3f} ± "
                f"{1e3 * row.gain_stderr:.3f}, is not above 2 s.e."
            )
        if over_rule is not None and not is_not_worse(*over_rule):
            unmet.append(
                "it is more than 2 s.e. behind the rule at T_r = "
                f"{self.validation.over_rule_request_temperature:g}"
            )
        return unmet

    def to_markdown(self) -> str:
        """Its validation and test rows beside T = 1 and the oracle (KL in 1e-3 nats), the T
        served with it at each request temperature, and whether it is recommended."""
        bands = ", ".join(f"{t:.3f} at T_r {t_r:g}" for t_r, t in self.band_temperatures.items())
        mapped = self.head_map
        lines = [
            (
                ""
                if mapped is None
                else f"Head map (rank {mapped.head_map.rank}, penalty {mapped.penalty:.1e}) + "
            )
            + f"Per-token bias + T: T = {self.correction.temperature:.3f} ({bands}), "
            f"{penalties_text(self.path.chosen)}"
            f"; {'recommended' if self.recommended else 'not recommended'} (it needs, on the "
            f"gate half, a gain over T = 1 above 2 s.e.{self._over_rule_text()})"
            + "".join(f"; not met: {condition}" for condition in self.unmet_conditions())
            + ". It changes greedy output and logprobs.",
            "",
            "| split | positions | KL(T=1) | KL(bias + T) | gain ± s.e. | share removed "
            "| KL(oracle T) | same top T=1 → bias |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, quality in (("validation (gate half)", self.validation), ("test", self.test)):
            row = quality.row
            lines.append(
                f"| {name} | {quality.positions} | {1e3 * quality.t_one.mean_kl:.3f} "
                f"| {1e3 * row.mean_kl:.3f} | {1e3 * row.gain:+.3f} ± {1e3 * row.gain_stderr:.3f} "
                f"| {100 * quality.share_removed:+.1f}% | {1e3 * quality.oracle.mean_kl:.3f} "
                f"| {100 * quality.same_top_rate_t_one:.1f}% → {100 * quality.same_top_rate:.1f}% |"
            )
        return "\n".join(lines) + "\n"

    def _over_rule_text(self) -> str:
        over_rule = self.validation.over_rule
        if self.rule is None or over_rule is None:
            return ""
        gain, stderr = over_rule
        return (
            f" and to be ahead of the `{self.rule.value}` rule it would replace or within 2 s.e. "
            "of it at every request temperature: where it is furthest behind, T_r = "
            f"{self.validation.over_rule_request_temperature:g}, "
            f"{1e3 * gain:+.3f} ± {1e3 * stderr:.3f} (1e-3 nats)"
        )

    def summary(self) -> BiasSummary:
        """What the profile records (the vector and the head map themselves are written by
        `correction.files.save_bias_file` and `save_head_map_file`)."""
        mapped = self.head_map
        head_penalty = self.path.chosen.head_penalty
        over_rule = self.validation.over_rule
        return BiasSummary(
            sha256=bias_sha256(self.correction.bias),
            vocab_size=int(self.correction.bias.numel()),
            temperature=self.correction.temperature,
            penalty=self.path.refine_penalty,
            head_penalty=head_penalty if math.isfinite(head_penalty) else None,
            fitted_rows=self.fitted_rows,
            recommended=self.recommended,
            validation=self.validation.row,
            test=self.test.row,
            validation_same_top_rate=self.validation.same_top_rate,
            test_same_top_rate=self.test.same_top_rate,
            rule=self.rule,
            gain_over_rule=None if over_rule is None else over_rule[0],
            gain_over_rule_stderr=None if over_rule is None else over_rule[1],
            gain_over_rule_request_temperature=self.validation.over_rule_request_temperature,
            band_temperatures=tuple(self.band_temperatures.values()),
            head_map=None if mapped is None else head_map_sha256(mapped.head_map),
            head_map_rank=None if mapped is None else mapped.head_map.rank,
            head_map_penalty=None if mapped is None else mapped.penalty,
        )


def penalties_text(fit: BiasFit) -> str:
    """The penalties of a fit in words: its head-span and per-token parts, or T only."""
    if not fit.has_bias:
        return "no bias (T only won on the selection half)"
    parts = [f"head-span penalty {fit.head_penalty:.1e}"] if math.isfinite(fit.head_penalty) else []
    if math.isfinite(fit.penalty):
        parts.append(f"per-token penalty {fit.penalty:.1e}")
    return ", ".join(parts)


def calibrate_bias(
    rows: PairedRows,
    settings: CalibrationSettings,
    basis: Tensor | None = None,
    *,
    rule: TemperaturePolicy | None = None,
    row_records: PositionRecords | None = None,
    head_map_rank: int = 0,
) -> BiasCalibration:
    """Fit and measure the bias on calibration rows, split by prompt exactly as
    `calibrate_records` splits the records (same fractions and seed, the validation prompts
    halved alike): `fit_bias_for_serving` (with the output head's `basis`, if given) on the
    fit and validation prompts, measured on the test prompts. With `rule` (the recommended
    temperature rule) and `row_records` (the records at request temperature 1 of the positions
    of `rows`, row for row), the bias is also measured against that rule on the gate half, and
    recommended only if not significantly worse than it (`BiasCalibration.recommended`).
    The bias is served with a T of its own at every request temperature of `settings`
    (`fit_band_temperatures` on the fit and validation rows, as the served fit), and compared
    with the rule so.
    With `head_map_rank` > 0 (and a `basis`), a `HeadMap` of that rank is fitted first on the
    fit prompts (its penalty chosen on the validation prompts' selection half) and the bias is
    fitted and measured on top of it: the correction is then the map and the bias together.
    Raises `InsufficientDataError` when a split is too small (see `bias_quality`)."""
    fit, validation, test = split_fit_validation_test(
        rows.sequence_id.cpu(),
        settings.validation_fraction,
        settings.test_fraction,
        settings.seed,
    )
    rule_temperatures = None
    if rule is not None and row_records is not None:
        if len(row_records) != len(rows):
            raise ValueError(f"{len(row_records)} row records for {len(rows)} rows")
        rule_temperatures = rule_temperatures_by_request_temperature(
            rule, row_records.select(validation), settings.request_temperatures
        )
    path, validation_quality, head_map = fit_bias_for_serving(
        rows.select(fit),
        rows.select(validation),
        settings,
        basis,
        rule_temperatures=rule_temperatures,
        head_map_rank=head_map_rank,
    )
    mapped = rows if head_map is None else head_map.head_map.mapped(rows)
    fitted = mapped.select(fit | validation)
    return BiasCalibration(
        path=path,
        fitted_rows=len(fitted),
        band_temperatures=fit_band_temperatures(
            fitted, path.chosen.correction, settings.request_temperatures, settings.bounds
        ),
        validation=validation_quality,
        test=bias_quality(
            mapped.select(test),
            path.chosen.correction,
            settings.min_quality_positions,
            unmapped=None if head_map is None else rows.select(test),
        ),
        rule=None if rule_temperatures is None or rule is None else rule.rule,
        head_map=head_map,
    )


def rule_temperatures_by_request_temperature(
    rule: TemperaturePolicy, records: PositionRecords, request_temperatures: Sequence[float]
) -> dict[float, Tensor]:
    """The rule's T at every position of `records` (measured at T_r = 1) for each request
    temperature: what the rule reads of a position does not depend on T_r (the served row's
    own features), only the band it picks does."""
    return {
        t_r: rule_temperatures_of(
            rule,
            replace(records, request_temperature=torch.full_like(records.request_temperature, t_r)),
        )
        for t_r in request_temperatures
    }


def fit_bias_for_serving(
    fit: PairedRows,
    validation: PairedRows,
    settings: CalibrationSettings,
    basis: Tensor | None = None,
    *,
    rule_temperatures: Mapping[float, Tensor] | None = None,
    head_map_rank: int = 0,
) -> tuple[BiasPath, BiasQuality, HeadMapFit | None]:
    """The bias to serve from fit and validation rows. The validation rows are halved by prompt
    (`split_selection_gate`, as `calibrate_records` halves its records): the penalties are
    chosen on the selection half with fits on `fit` (`fit_logit_bias`, with the output head's
    `basis` if given), and that fit's quality on the gate half is returned (it decides the
    recommendation, on rows that took no part in the choice); the bias served is then refitted
    at those penalties on all of `fit` and `validation` (more data, no further choice; warm
    start). With `rule_temperatures` (a temperature rule's T at each validation row, by request
    temperature), the gate half's quality also compares the bias with that rule
    (`BiasQuality.over_rule`), the bias served at each request temperature with its T fitted
    there on `fit` (`fit_band_temperatures`). With `head_map_rank` > 0 (and a `basis`), a
    `HeadMap` of that rank is fitted first on `fit` (its penalty chosen on the selection half)
    and returned, and all of the above runs on the mapped rows, measured against the rows as
    served (`bias_quality`'s `unmapped`); else the map returned is None. Raises
    `InsufficientDataError` when a half is too small (see `bias_quality`)."""
    selection, gate = split_selection_gate(validation.sequence_id.cpu(), settings.seed)
    served_validation, head_map = validation, None
    if head_map_rank:
        if basis is None:
            raise ValueError("a head map needs the output head's weights (basis)")
        head_map = fit_head_map(fit, validation.select(selection), basis, head_map_rank)
        fit, validation = head_map.head_map.mapped(fit), head_map.head_map.mapped(validation)
    path = fit_logit_bias(fit, validation.select(selection), basis=basis, bounds=settings.bounds)
    gate_quality = bias_quality(
        validation.select(gate),
        path.chosen.correction,
        settings.min_quality_positions,
        rule_temperatures=None
        if rule_temperatures is None
        else {t_r: temperatures[gate] for t_r, temperatures in rule_temperatures.items()},
        band_temperatures=None
        if rule_temperatures is None
        else fit_band_temperatures(
            fit, path.chosen.correction, list(rule_temperatures), settings.bounds
        ),
        unmapped=None if head_map is None else served_validation.select(gate),
    )
    chosen = path.chosen
    refit = fit_bias_at_penalty(
        PairedRows.concat([fit, validation]),
        chosen.penalty,
        basis=basis,
        head_penalty=chosen.head_penalty,
        bounds=settings.bounds,
        start=chosen,
        fit_bias=math.isfinite(chosen.penalty),
    )
    return replace(path, chosen=refit), gate_quality, head_map
