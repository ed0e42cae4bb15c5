"""Fitting every rule's parameters on calibration records (the fit set).

All fits read the records' KL curves (`interpolate_kl`), never logits: `fixed` is the best
shared T; `sqrt`/`linear` use alpha by step bucket (ratio of mean sigma2 to mean tau2 in the
bucket, `noise_by_step`); `fisher` uses sigma2 by step bucket and a fitted floor on Var_q;
`schedule` fits (t_max, beta); `calibrated` is a significance-gated table
(`calibration.calibrated_table`). The one-T curve fits are `calibration.curves`'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor

from noisy_temp_server.calibration.calibrated_table import fit_calibrated_table
from noisy_temp_server.calibration.curves import (
    best_curve_temperature,
    best_inverse_scale,
    step_bucket,
)
from noisy_temp_server.calibration.profile import RuleParameters, StepBucketNoise
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    InsufficientDataError,
    split_by_sequence,
)
from noisy_temp_server.scoring.records import KLCurveInterpolant, PositionRecords, interpolate_kl
from noisy_temp_server.temperature.policy import (
    CalibratedTable,
    TemperaturePolicy,
)
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds
from noisy_temp_server.temperature.stats import ServedRowFeatures

__all__ = [
    "FITTED_RULES",
    "finite_positions",
    "fit_rules",
    "noise_by_step",
    "rule_temperatures",
]

FITTED_RULES: tuple[Rule, ...] = (
    Rule.FIXED,
    Rule.SQRT,
    Rule.LINEAR,
    Rule.FISHER,
    Rule.SCHEDULE,
    Rule.CALIBRATED,
)
_FISHER_FLOOR_RANGE = (1e-3, 1e3)
_SCHEDULE_BETA_RANGE = (1e-4, 10.0)
_GOLDEN_LOG_TOLERANCE = 1e-3
"""Golden-section searches stop when the bracket is this narrow in log(parameter)."""


def noise_by_step(records: PositionRecords, step_edges: Sequence[int]) -> list[StepBucketNoise]:
    """sigma2, tau2 and alpha = mean sigma2 / mean tau2 per step bucket (edges start at 0).

    An empty bucket takes the values of the nearest earlier non-empty one (the first non-empty
    bucket's values fill empty leading buckets), with `positions = 0`.
    """
    bucket = step_bucket(records.step, step_edges)
    finite = torch.isfinite(records.sigma2) & torch.isfinite(records.tau2)
    measured: list[tuple[int, float, float]] = []
    for b in range(len(step_edges)):
        rows = (bucket == b) & finite
        count = int(rows.sum())
        if count:
            measured.append(
                (
                    count,
                    float(records.sigma2[rows].double().mean()),
                    float(records.tau2[rows].double().mean()),
                )
            )
        else:
            measured.append((0, math.nan, math.nan))
    if all(count == 0 for count, _, _ in measured):
        raise InsufficientDataError("no position with finite sigma2 and tau2 to estimate noise")
    first = next(m for m in measured if m[0])
    result = []
    previous = first
    for b, bucket_noise in enumerate(measured):
        count = bucket_noise[0]
        if count:
            previous = bucket_noise
        _, sigma2, tau2 = previous
        stop = step_edges[b + 1] if b + 1 < len(step_edges) else None
        result.append(
            StepBucketNoise(
                step_start=step_edges[b],
                step_stop=stop,
                positions=count,
                alpha=sigma2 / tau2 if tau2 > 0 else 0.0,
                sigma2=sigma2,
                tau2=tau2,
            )
        )
    return result


def _mean_kl(records: PositionRecords, temperatures: Tensor) -> Tensor:
    """Mean interpolated KL of `records` at per-row `temperatures` [N] -> scalar."""
    return (
        interpolate_kl(records.kl_curve, records.curve_temperatures, temperatures).double().mean()
    )


def _golden_section(
    objective: Callable[[float], float], low: float, high: float, tolerance: float
) -> tuple[float, float]:
    """(x, objective(x)) at a minimum of `objective` on [low, high], by golden-section search.

    Finds the minimum when `objective` has a single one on the interval (else a local one);
    stops when the bracket is narrower than `tolerance`.
    """
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    left, right = high - ratio * (high - low), low + ratio * (high - low)
    f_left, f_right = objective(left), objective(right)
    while high - low > tolerance:
        if f_left <= f_right:
            high, right, f_right = right, left, f_left
            left = high - ratio * (high - low)
            f_left = objective(left)
        else:
            low, left, f_left = left, right, f_right
            right = low + ratio * (high - low)
            f_right = objective(right)
    return (left, f_left) if f_left <= f_right else (right, f_right)


def _fisher_floor(records: PositionRecords, fisher: TemperaturePolicy) -> float:
    """The Var_q floor in [1e-3, 1e3] minimising mean KL of the `fisher` policy.

    Golden-section search on log(floor) to `_GOLDEN_LOG_TOLERANCE` (the mean KL is not convex
    in the floor; the search assumes it has one minimum on the interval).
    """

    def mean_kl(log_floor: float) -> float:
        candidate = dataclasses.replace(fisher, fisher_var_floor=math.exp(log_floor))
        return float(_mean_kl(records, rule_temperatures(candidate, records)))

    low, high = (math.log(x) for x in _FISHER_FLOOR_RANGE)
    log_floor, _ = _golden_section(mean_kl, low, high, _GOLDEN_LOG_TOLERANCE)
    return math.exp(log_floor)


def _schedule(records: PositionRecords, bounds: TemperatureBounds) -> tuple[float, float]:
    """(t_max, beta) of T(step) = t_max / sqrt(1 + beta step) minimising mean KL.

    For a fixed beta, u = sqrt(1 + beta step) / t_max is linear in c = 1/t_max, so t_max is a
    convex solve (`best_inverse_scale`). beta = 0 is solved, and beta in [1e-4, 10] by
    golden-section search on log(beta) (the search assumes one minimum on that interval); the
    smaller mean KL wins, beta = 0 on a tie.
    """
    curves = KLCurveInterpolant(records.kl_curve, records.curve_temperatures)
    steps = records.step.double().clamp(min=0.0)

    def solve(beta: float) -> tuple[float, float]:
        return best_inverse_scale(curves, (1.0 + beta * steps).sqrt(), bounds)

    def mean_kl(log_beta: float) -> float:
        return solve(math.exp(log_beta))[1]

    low, high = (math.log(x) for x in _SCHEDULE_BETA_RANGE)
    log_beta, kl = _golden_section(mean_kl, low, high, _GOLDEN_LOG_TOLERANCE)
    c_flat, kl_flat = solve(0.0)
    if kl_flat <= kl:
        return 1.0 / c_flat, 0.0
    beta = math.exp(log_beta)
    return 1.0 / solve(beta)[0], beta


def _calibrated_table(
    records: PositionRecords, settings: CalibrationSettings, validation: PositionRecords | None
) -> CalibratedTable:
    """The calibrated table fitted on `records` and checked on `validation` (its finite
    positions), or, without it, on `settings.validation_fraction` of `records`' sequences split
    off (see `fit_rules`)."""
    if validation is None:
        table_fit, table_check = split_by_sequence(
            records.sequence_id, settings.validation_fraction, settings.seed + 1
        )
        table_records, validation = records.select(table_fit), records.select(table_check)
    else:
        table_records, validation = records, finite_positions(validation)
    return fit_calibrated_table(
        table_records,
        validation,
        step_edges=tuple(settings.step_edges),
        entropy_buckets=settings.entropy_buckets,
        bounds=settings.bounds,
        min_cell_positions=settings.min_cell_positions,
    )


def fit_rules(
    records: PositionRecords,
    settings: CalibrationSettings,
    rules: Collection[Rule] = FITTED_RULES,
    *,
    validation: PositionRecords | None = None,
) -> tuple[RuleParameters, list[StepBucketNoise]]:
    """Fit the parameters of `rules` (default: every rule) on `records` (the fit set; see the
    module docstring).

    The noise by step bucket (alpha and sigma2, all that `sqrt` and `linear` need) is always
    fitted; `fixed` adds the best shared T, `fisher` the Var_q floor, `schedule` (t_max, beta)
    and `calibrated` the table. The parameters of rules not in `rules` are the neutral ones of
    `TemperaturePolicy` (T = 1: fixed T 1, floor 1, schedule t_max 1 / beta 0, an all-ones
    table). The calibrated table is fitted on `records` and its departures from T = 1 and from
    each band's constant checked on `validation` (`fit_calibrated_table`, one band per request
    temperature of the records, the bands' constants gated against T = 1 jointly). Without
    `validation` (the online estimator), `records` is split by sequence for that
    (`settings.validation_fraction` to check). Every other parameter is fitted on the
    positions measured at request temperature 1. Positions whose KL is
    infinite at every T (the served row masks a token the clean row supports) carry no
    information about T and are left out, as in
    `noisy_temp_server.calibration.quality.quality_table`. Raises
    `InsufficientDataError` when there is nothing to fit on at request temperature 1 (or, for
    `calibrated` without `validation`, fewer than two sequences).
    """
    records = finite_positions(records)
    bounds = settings.bounds
    step_edges = tuple(settings.step_edges)
    table = (
        _calibrated_table(records, settings, validation)
        if Rule.CALIBRATED in rules
        else CalibratedTable(
            step_edges=step_edges, temperatures=(tuple((1.0,) for _ in step_edges),)
        )
    )
    records = records.select(records.request_temperature == 1.0)
    if len(records) == 0:
        raise InsufficientDataError("no position measured at request temperature 1 to fit on")
    noise = noise_by_step(records, step_edges)
    alpha_by_step = tuple(max(n.alpha, 0.0) for n in noise)
    sigma2_by_step = tuple(max(n.sigma2, 0.0) for n in noise)
    neutral = TemperaturePolicy()
    t_max, beta = (
        _schedule(records, bounds)
        if Rule.SCHEDULE in rules
        else (neutral.schedule_t_max, neutral.schedule_beta)
    )
    fixed_temperature = (
        best_curve_temperature(records.kl_curve, records.curve_temperatures, bounds)
        if Rule.FIXED in rules
        else neutral.fixed_temperature
    )
    fisher_var_floor = neutral.fisher_var_floor
    if Rule.FISHER in rules:
        fisher = TemperaturePolicy(
            rule=Rule.FISHER,
            bounds=bounds,
            step_edges=step_edges,
            alpha_by_step=alpha_by_step,
            sigma2_by_step=sigma2_by_step,
        )
        fisher_var_floor = _fisher_floor(records, fisher)
    parameters = RuleParameters(
        t_min=bounds.t_min,
        t_max=bounds.t_max,
        fixed_temperature=fixed_temperature,
        step_edges=step_edges,
        alpha_by_step=alpha_by_step,
        sigma2_by_step=sigma2_by_step,
        fisher_var_floor=fisher_var_floor,
        schedule_t_max=t_max,
        schedule_beta=beta,
        calibrated_step_edges=table.step_edges,
        calibrated_entropy_edges=table.entropy_edges,
        calibrated_request_temperature_edges=table.request_temperature_edges,
        calibrated_temperatures=table.temperatures,
    )
    return parameters, noise


def finite_positions(records: PositionRecords) -> PositionRecords:
    """The positions whose KL is finite (at T = 1, hence at every T)."""
    return records.select(torch.isfinite(records.kl_at_one))


def rule_temperatures(policy: TemperaturePolicy, records: PositionRecords) -> Tensor:
    """T of `policy` at every position of `records` -> float32 [N], within the policy bounds.

    `policy_temperature` (the one implementation of rule -> T), with the served-row features
    the records keep (entropy, Var_q, top probability) in place of the served logits.
    """
    features = ServedRowFeatures(
        entropy=records.served_entropy,
        var_q=records.served_var,
        top_prob=records.served_top_prob,
    )
    return policy_temperature(
        policy,
        records.step,
        served_features=features,
        request_temperature=records.request_temperature,
    )
