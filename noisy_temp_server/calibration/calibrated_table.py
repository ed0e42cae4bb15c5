"""The `calibrated` rule's table, fitted top-down on calibration records with a significance
check at every split (`fit_calibrated_table`): T by (request-temperature band, step bucket,
entropy bucket), each split kept only when it beats its parent on validation requests."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from noisy_temp_server.calibration.curves import (
    best_curve_temperature,
    request_temperatures_of,
    step_bucket,
)
from noisy_temp_server.calibration.significance import (
    is_material_gain,
    is_not_worse,
)
from noisy_temp_server.scoring.records import PositionRecords, interpolate_kl
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.temperature.policy import (
    CalibratedTable,
    request_temperature_band_edges,
)
from noisy_temp_server.temperature.policy_eval import bucket_index
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = ["fit_calibrated_table"]


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
    fit_steps, validation_steps = (step_bucket(r.step, step_edges) for r in (fit, validation))
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
