"""The per-token logit bias on calibration data: the fit with its penalty chosen on the
selection half of the validation prompts, and its quality rows on the gate half (the
recommendation) and on the test prompts (measured by `calibration.bias_quality` on the paired
rows `score_with_rows` keeps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from noisy_temp_server.calibration.bias_quality import BiasQuality, bias_quality
from noisy_temp_server.calibration.fitting import rule_temperatures as rule_temperatures_of
from noisy_temp_server.calibration.profile import BiasSummary
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    is_not_worse,
    is_significant,
    split_fit_validation_test,
    split_selection_gate,
)
from noisy_temp_server.correction.bias import BiasFit, BiasPath, fit_bias_at_penalty, fit_logit_bias
from noisy_temp_server.correction.files import bias_sha256
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows
from noisy_temp_server.correction.request_bands import (
    at_request_temperature,
    best_temperature,
)
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds

__all__ = [
    "BiasCalibration",
    "calibrate_bias",
    "fit_band_temperatures",
    "fit_bias_for_serving",
    "penalties_text",
    "rule_temperatures_by_request_temperature",
]


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
        lines = [
            f"Per-token bias + T: T = {self.correction.temperature:.3f} ({bands}), "
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
        """What the profile records (the vector itself is written by
        `correction.files.save_bias_file`)."""
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
    with the rule so. Raises `InsufficientDataError` when a split is too small (see
    `bias_quality`)."""
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
    path, validation_quality = fit_bias_for_serving(
        rows.select(fit),
        rows.select(validation),
        settings,
        basis,
        rule_temperatures=rule_temperatures,
    )
    fitted = rows.select(fit | validation)
    return BiasCalibration(
        path=path,
        fitted_rows=len(fitted),
        band_temperatures=fit_band_temperatures(
            fitted, path.chosen.correction, settings.request_temperatures, settings.bounds
        ),
        validation=validation_quality,
        test=bias_quality(
            rows.select(test), path.chosen.correction, settings.min_quality_positions
        ),
        rule=None if rule_temperatures is None or rule is None else rule.rule,
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
) -> tuple[BiasPath, BiasQuality]:
    """The bias to serve from fit and validation rows. The validation rows are halved by prompt
    (`split_selection_gate`, as `calibrate_records` halves its records): the penalties are
    chosen on the selection half with fits on `fit` (`fit_logit_bias`, with the output head's
    `basis` if given), and that fit's quality on the gate half is returned (it decides the
    recommendation, on rows that took no part in the choice); the bias served is then refitted
    at those penalties on all of `fit` and `validation` (more data, no further choice; warm
    start). With `rule_temperatures` (a temperature rule's T at each validation row, by request
    temperature), the gate half's quality also compares the bias with that rule
    (`BiasQuality.over_rule`), the bias served at each request temperature with its T fitted
    there on `fit` (`fit_band_temperatures`). Raises `InsufficientDataError` when a half is
    too small (see `bias_quality`)."""
    selection, gate = split_selection_gate(validation.sequence_id.cpu(), settings.seed)
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
    return replace(path, chosen=refit), gate_quality
