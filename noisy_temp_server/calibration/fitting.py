"""Fitting every rule's parameters on calibration records (the fit set).

All fits read the records' KL curves (`interpolate_kl`), never logits: `fixed` is the best
shared T; `sqrt`/`linear` use alpha by step bucket (ratio of mean sigma2 to mean tau2 in the
bucket, `noise_by_step`); `fisher` uses sigma2 by step bucket and a fitted floor on Var_q;
`schedule` fits (t_max, beta); `calibrated` is a significance-gated table
(`fit_calibrated_table`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor

from noisy_temp_server.calibration.profile import (
    CalibrationSettings,
    RuleParameters,
    StepBucketNoise,
)
from noisy_temp_server.calibration.significance import (
    InsufficientDataError,
    is_material_gain,
    is_not_worse,
    split_by_sequence,
)
from noisy_temp_server.pairs.records import KLCurveInterpolant, PositionRecords, interpolate_kl
from noisy_temp_server.pairs.standard_error import cluster_stderr
from noisy_temp_server.temperature.oracle import minimise_convex
from noisy_temp_server.temperature.policy import (
    CalibratedTable,
    TemperaturePolicy,
    request_temperature_band_edges,
)
from noisy_temp_server.temperature.policy_eval import bucket_index, policy_temperature
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds
from noisy_temp_server.temperature.stats import ServedRowFeatures

__all__ = [
    "FITTED_RULES",
    "best_curve_temperature",
    "finite_positions",
    "fit_calibrated_table",
    "fit_rules",
    "noise_by_step",
    "request_temperatures_of",
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
_CURVE_RTOL = 1e-6
"""Relative tolerance in T of the convex fits on KL curves."""
_FISHER_FLOOR_RANGE = (1e-3, 1e3)
_SCHEDULE_BETA_RANGE = (1e-4, 10.0)
_GOLDEN_LOG_TOLERANCE = 1e-3
"""Golden-section searches stop when the bracket is this narrow in log(parameter)."""


def _step_bucket(step: Tensor, edges: Sequence[int]) -> Tensor:
    return bucket_index(step, torch.tensor(edges, dtype=torch.int64))


def noise_by_step(records: PositionRecords, step_edges: Sequence[int]) -> list[StepBucketNoise]:
    """sigma2, tau2 and alpha = mean sigma2 / mean tau2 per step bucket (edges start at 0).

    An empty bucket takes the values of the nearest earlier non-empty one (the first non-empty
    bucket's values fill empty leading buckets), with `positions = 0`.
    """
    bucket = _step_bucket(records.step, step_edges)
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


def _best_inverse_scale(
    curves: KLCurveInterpolant, scale: Tensor, bounds: TemperatureBounds
) -> tuple[float, float]:
    """(c, mean KL) minimising the mean over rows of KL_i(T_i), T_i = 1 / (c * scale_i).

    T_i is clamped into `bounds` (flat there); c is sought with 1/c in `bounds` and in the
    curves' grid (beyond the grid a curve is flat, so 1/c there gains nothing). Each row's KL
    is convex in u = c * scale_i, so the mean is convex in c up to the interpolation error;
    `minimise_convex` (safeguarded Newton/bisection) solves it to `_CURVE_RTOL` in c.
    """
    log_scale = scale.double().log()
    log_low, log_high = math.log(bounds.t_min), math.log(bounds.t_max)
    log_grid = curves.log_grid

    def evaluate(c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        log_t = -c.log() - log_scale
        inside = (log_t >= log_low) & (log_t <= log_high)
        value, slope, curvature = curves.at(log_t.clamp(log_low, log_high))
        slope, curvature = slope * inside, curvature * inside
        # d log T / dc = -1 / c:  d/dc = -slope / c, d2/dc2 = (curvature + slope) / c^2.
        return (
            value.mean().reshape(1),
            (-slope.mean() / c).reshape(1),
            ((curvature + slope).mean() / c.square()).reshape(1),
        )

    t_high = min(bounds.t_max, math.exp(float(log_grid[-1])))
    t_low = max(bounds.t_min, math.exp(float(log_grid[0])))
    c_low = torch.full((1,), 1.0 / t_high, dtype=torch.float64)
    c_high = torch.full((1,), 1.0 / t_low, dtype=torch.float64)
    c, kl = minimise_convex(evaluate, c_low, c_high, rtol=_CURVE_RTOL)
    return float(c), float(kl)


def best_curve_temperature(
    kl_curves: Tensor, curve_temperatures: Tensor, bounds: TemperatureBounds
) -> float:
    """The one T in `bounds` minimising the mean of the rows' interpolated KL curves.

    kl_curves: [N, G] (N >= 1). Interpolation is linear in the curve values, so this minimises
    the interpolated mean curve, by the convex solve of `_best_inverse_scale` (u = 1/T).
    """
    if kl_curves.shape[0] == 0:
        raise InsufficientDataError("no positions to fit a temperature on")
    mean_curve = kl_curves.double().mean(dim=0, keepdim=True)  # [1, G]
    curves = KLCurveInterpolant(mean_curve, curve_temperatures)
    c, _ = _best_inverse_scale(curves, torch.ones(1, dtype=torch.float64), bounds)
    return 1.0 / c


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


def _entropy_edges(entropy: Tensor, buckets: int) -> tuple[float, ...]:
    """Edges (from 0) splitting the served entropy into `buckets` quantile buckets."""
    if buckets == 1 or entropy.numel() == 0:
        return (0.0,)
    quantiles = torch.quantile(entropy.double(), torch.linspace(0, 1, buckets + 1)[1:-1].double())
    edges = [0.0]
    for q in quantiles.tolist():
        if q > edges[-1] + 1e-6:
            edges.append(round(q, 6))
    return tuple(edges)


def _entropy_bucket(entropy: Tensor, edges: Sequence[float]) -> Tensor:
    return bucket_index(entropy.float(), torch.tensor(edges, dtype=torch.float32))


def _validation_gain(
    validation: PositionRecords, parent: float, candidate: float
) -> tuple[Tensor, float]:
    """Per-position KL(parent) - KL(candidate) on `validation` -> (float64 [N], the mean
    KL(parent)), both constant T read off the KL curves."""
    at_parent, at_candidate = (
        interpolate_kl(
            validation.kl_curve, validation.curve_temperatures, torch.full((len(validation),), t)
        ).double()
        for t in (parent, candidate)
    )
    return at_parent - at_candidate, float(at_parent.mean())


def _beats(gain: Tensor, reference_kl: float, sequence_ids: Tensor) -> bool:
    """Whether per-position `gain` [N] over a reference of mean KL `reference_kl` is a material
    gain (`is_material_gain`: significant, clustered by `sequence_ids`, and above the floor
    the curves' interpolation error calls for)."""
    return is_material_gain(float(gain.mean()), cluster_stderr(gain, sequence_ids), reference_kl)


def _refined_temperature(
    parent: float,
    fit: PositionRecords,
    validation: PositionRecords,
    bounds: TemperatureBounds,
    min_positions: int,
) -> float:
    """The best shared T of `fit`, if it beats `parent` on `validation` (`_beats`); else
    `parent`. Cells with fewer than `min_positions` positions in either set keep `parent`."""
    if min(len(fit), len(validation)) < min_positions:
        return parent
    candidate = best_curve_temperature(fit.kl_curve, fit.curve_temperatures, bounds)
    gain, parent_kl = _validation_gain(validation, parent, candidate)
    return candidate if _beats(gain, parent_kl, validation.sequence_id) else parent


def _band_roots(
    bands: Sequence[tuple[PositionRecords, PositionRecords]],
    bounds: TemperatureBounds,
    min_positions: int,
) -> tuple[float, ...]:
    """The root T of each band of `fit_calibrated_table`, from its (fit, validation) records.

    A band's candidate is the best constant of its `fit` positions (none, so T = 1, when
    either set has fewer than `min_positions` positions). The candidates are tested against
    T = 1 jointly: the paired gain KL(1) - KL(candidate) on the validation positions of all
    bands pooled, with standard errors clustered by prompt (one prompt's positions at every
    request temperature form one cluster, as they share a completion). A band serves its
    candidate when its own validation gain beats T = 1 (`_beats`: significant and above the
    interpolation floor), or when the joint gain does and the band's own gain is not
    significantly negative (`is_not_worse`); else it serves T = 1. Pooling lends the bands
    each other's strength: a constant that helps at every request temperature by a little is
    served even when no band alone has the prompts to show it, while a band whose constant its
    own prompts show to be harmful still gets 1.
    """
    roots = [1.0] * len(bands)
    checks: dict[int, tuple[float, Tensor, float, Tensor]] = {}
    for index, (fit, validation) in enumerate(bands):
        if min(len(fit), len(validation)) >= min_positions:
            candidate = best_curve_temperature(fit.kl_curve, fit.curve_temperatures, bounds)
            gain, kl_one = _validation_gain(validation, 1.0, candidate)
            checks[index] = (candidate, gain, kl_one, validation.sequence_id)
    if not checks:
        return tuple(roots)
    pooled = torch.cat([gain for _, gain, _, _ in checks.values()])
    pooled_ids = torch.cat([ids for _, _, _, ids in checks.values()])
    pooled_kl_one = sum(kl * len(gain) for _, gain, kl, _ in checks.values()) / len(pooled)
    joint = _beats(pooled, pooled_kl_one, pooled_ids)
    for index, (candidate, gain, kl_one, ids) in checks.items():
        own_not_worse = is_not_worse(float(gain.mean()), cluster_stderr(gain, ids))
        if _beats(gain, kl_one, ids) or (joint and own_not_worse):
            roots[index] = candidate
    return tuple(roots)


def fit_calibrated_table(
    fit: PositionRecords,
    validation: PositionRecords,
    *,
    step_edges: Sequence[int],
    entropy_buckets: int,
    bounds: TemperatureBounds,
    min_cell_positions: int,
) -> CalibratedTable:
    """The calibrated table: one T per (request-temperature band, step bucket, served-entropy
    bucket), each band fitted top-down on the positions measured at its request temperature.

    One band per distinct request temperature of `fit` (`validation` must have the same ones),
    its edges the midpoints between them. A band's root is its best constant (at T_r = 1, the
    `fixed` rule's T) or T = 1, by the gate of `_band_roots`: the bands' constants are tested
    against T = 1 jointly on the validation positions of all bands, and a band keeps its
    constant when the joint gain (or its own) is significant and its own validation positions
    do not show the constant significantly worse than T = 1. Below the root, every node of the
    hierarchy (step bucket -> step bucket x entropy bucket) starts from its parent's T; its own
    T is the best shared T of its `fit` positions, kept only if the node has at least
    `min_cell_positions` positions in both sets and that T beats the parent's on the node's
    `validation` positions significantly (paired gain minus 2 cluster-robust standard errors
    > 0); otherwise the node inherits the parent's T, so a cell with thin evidence takes the
    coarser estimate. The rule is never behind a band's constant, nor behind T = 1, beyond
    statistical noise. Entropy edges are quantiles of `fit`'s served entropy.
    """
    entropy_edges = _entropy_edges(fit.served_entropy, entropy_buckets)
    request_temperatures = request_temperatures_of(fit)
    if request_temperatures_of(validation) != request_temperatures:
        raise ValueError("fit and validation records must share their request temperatures")
    bands = [
        (
            fit.select(fit.request_temperature == t),
            validation.select(validation.request_temperature == t),
        )
        for t in request_temperatures
    ]
    roots = _band_roots(bands, bounds, min_cell_positions)
    return CalibratedTable(
        step_edges=tuple(step_edges),
        entropy_edges=entropy_edges,
        temperatures=tuple(
            _band_table(
                root,
                band_fit,
                band_validation,
                step_edges=step_edges,
                entropy_edges=entropy_edges,
                bounds=bounds,
                min_cell_positions=min_cell_positions,
            )
            for root, (band_fit, band_validation) in zip(roots, bands, strict=True)
        ),
        request_temperature_edges=request_temperature_band_edges(request_temperatures),
    )


def _band_table(
    root: float,
    fit: PositionRecords,
    validation: PositionRecords,
    *,
    step_edges: Sequence[int],
    entropy_edges: Sequence[float],
    bounds: TemperatureBounds,
    min_cell_positions: int,
) -> tuple[tuple[float, ...], ...]:
    """One band of `fit_calibrated_table` below its `root` T: T [step buckets][entropy
    buckets]."""
    refine = functools.partial(
        _refined_temperature, bounds=bounds, min_positions=min_cell_positions
    )
    fit_steps, validation_steps = (_step_bucket(r.step, step_edges) for r in (fit, validation))
    fit_entropy, validation_entropy = (
        _entropy_bucket(r.served_entropy, entropy_edges) for r in (fit, validation)
    )
    table = []
    for s in range(len(step_edges)):
        step_fit, step_validation = fit_steps == s, validation_steps == s
        step_t = refine(root, fit.select(step_fit), validation.select(step_validation))
        table.append(
            tuple(
                refine(
                    step_t,
                    fit.select(step_fit & (fit_entropy == e)),
                    validation.select(step_validation & (validation_entropy == e)),
                )
                for e in range(len(entropy_edges))
            )
        )
    return tuple(table)


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
    convex solve (`_best_inverse_scale`). beta = 0 is solved, and beta in [1e-4, 10] by
    golden-section search on log(beta) (the search assumes one minimum on that interval); the
    smaller mean KL wins, beta = 0 on a tie.
    """
    curves = KLCurveInterpolant(records.kl_curve, records.curve_temperatures)
    steps = records.step.double().clamp(min=0.0)

    def solve(beta: float) -> tuple[float, float]:
        return _best_inverse_scale(curves, (1.0 + beta * steps).sqrt(), bounds)

    def mean_kl(log_beta: float) -> float:
        return solve(math.exp(log_beta))[1]

    low, high = (math.log(x) for x in _SCHEDULE_BETA_RANGE)
    log_beta, kl = _golden_section(mean_kl, low, high, _GOLDEN_LOG_TOLERANCE)
    c_flat, kl_flat = solve(0.0)
    if kl_flat <= kl:
        return 1.0 / c_flat, 0.0
    beta = math.exp(log_beta)
    return 1.0 / solve(beta)[0], beta


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
    table = CalibratedTable(
        step_edges=step_edges, temperatures=(tuple((1.0,) for _ in step_edges),)
    )
    if Rule.CALIBRATED in rules:
        if validation is None:
            table_fit, table_check = split_by_sequence(
                records.sequence_id, settings.validation_fraction, settings.seed + 1
            )
            table_records, validation = records.select(table_fit), records.select(table_check)
        else:
            table_records, validation = records, finite_positions(validation)
        table = fit_calibrated_table(
            table_records,
            validation,
            step_edges=step_edges,
            entropy_buckets=settings.entropy_buckets,
            bounds=bounds,
            min_cell_positions=settings.min_cell_positions,
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


def request_temperatures_of(records: PositionRecords) -> tuple[float, ...]:
    """The distinct request temperatures `records` were measured at, ascending (rounded to 6
    decimals, so a float32 0.7 reads 0.7)."""
    return tuple(round(t, 6) for t in torch.unique(records.request_temperature).tolist())


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
