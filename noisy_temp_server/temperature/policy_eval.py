"""A policy evaluated on rows: :func:`policy_temperature`, the one implementation of
rule -> T per row (its lookup tables built once per policy object and device), and
:func:`step_temperatures`, one request's T as a function of its step alone, for the
processors' per-slot tables. The policy itself (fields, validation, JSON) is
`temperature.policy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.devices import upload
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import (
    Rule,
    clamp_temperature,
    fisher_temperature,
    linear_temperature,
    schedule_temperature,
    sqrt_temperature,
)
from noisy_temp_server.temperature.stats import ServedRowFeatures, served_row_features

__all__ = [
    "StepTemperatures",
    "bucket_index",
    "policy_temperature",
    "step_temperatures",
]


@dataclass(frozen=True)
class _PolicyTensors:
    """A policy's lookup tables on one device (float32 values, int64 step edges)."""

    step_edges: Tensor
    alpha_by_step: Tensor
    sigma2_by_step: Tensor
    calibrated_step_edges: Tensor
    calibrated_entropy_edges: Tensor
    calibrated_request_temperature_edges: Tensor
    calibrated_temperatures: Tensor  # [bands * step buckets * entropy buckets], row-major


_TABLES_CACHE_SIZE = 64
# (id(policy), device) -> (policy, its tables). Each entry keeps its policy alive, so the id
# stays unique while the entry exists; the key costs no hash of the policy's contents.
_tables_by_policy: dict[tuple[int, torch.device], tuple[TemperaturePolicy, _PolicyTensors]] = {}


def _policy_tensors(policy: TemperaturePolicy, device: torch.device) -> _PolicyTensors:
    """The policy's lookup tables on ``device``, built once per policy object (bounded FIFO)."""
    key = (id(policy), device)
    cached = _tables_by_policy.get(key)
    if cached is not None:
        return cached[1]
    tables = _build_policy_tensors(policy, device)
    if len(_tables_by_policy) >= _TABLES_CACHE_SIZE:
        _tables_by_policy.pop(next(iter(_tables_by_policy)), None)
    _tables_by_policy[key] = (policy, tables)
    return tables


def _on_device(data: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``data`` as a tensor on ``device``, copied without a host sync, so that a policy's first
    step inside the engine's sampler does not stall it."""
    return upload(torch.tensor(data, dtype=dtype), device, pin=device.type == "cuda")


def _build_policy_tensors(policy: TemperaturePolicy, device: torch.device) -> _PolicyTensors:
    def values(data: Sequence[float]) -> Tensor:
        return _on_device(data, torch.float32, device)

    table = policy.calibrated
    return _PolicyTensors(
        step_edges=_on_device(policy.step_edges, torch.int64, device),
        alpha_by_step=values(policy.alpha_by_step),
        sigma2_by_step=values(policy.sigma2_by_step),
        calibrated_step_edges=_on_device(table.step_edges, torch.int64, device),
        calibrated_entropy_edges=values(table.entropy_edges),
        calibrated_request_temperature_edges=values(table.request_temperature_edges),
        calibrated_temperatures=values(
            [t for band in table.temperatures for row in band for t in row]
        ),
    )


def bucket_index(values: Tensor, edges: Tensor) -> Tensor:
    """The bucket of each value: int64 ``i`` with ``edges[i] <= value < edges[i + 1]``.

    ``edges`` is 1-D, strictly ascending and starts at 0 (step or entropy bucket edges, as in a
    policy); the last bucket is open-ended and values below the first edge go to bucket 0.
    ``values`` has any shape (same device as ``edges``); the result has its shape. NaN values
    land in the last bucket, so callers that may see NaN must handle it themselves.
    """
    return (torch.bucketize(values, edges, right=True) - 1).clamp_(min=0)


def _checked_inputs(
    policy: TemperaturePolicy,
    step: Tensor,
    served_logits: Tensor | None,
    served_features: ServedRowFeatures | None,
    *,
    validate: bool,
    per_row: dict[str, Tensor | None],
    request_temperature: Tensor | None,
) -> ServedRowFeatures | None:
    """The served-row features `policy` reads (None when it reads none), computed from
    `served_logits` unless given; ValueError for wrong shapes or missing served input (see
    `policy_temperature`)."""
    if step.dim() != 1:
        raise ValueError(f"step must have shape [batch], got {tuple(step.shape)}")
    batch, rule = step.shape[0], policy.rule
    if served_logits is not None and served_features is not None:
        raise ValueError("give served_logits or served_features, not both")
    if served_logits is not None and (served_logits.dim() != 2 or served_logits.shape[0] != batch):
        raise ValueError(
            f"served_logits must have shape [{batch}, vocab], got {tuple(served_logits.shape)}"
        )
    if policy.reads_served_row:
        if served_features is None:
            if served_logits is None:
                raise ValueError(
                    f"rule {rule.value!r} reads the served row; pass served_logits "
                    "(or served_features)"
                )
            served_features = served_row_features(
                served_logits, validate=validate, need_variance=rule is Rule.FISHER
            )
        elif served_features.entropy.shape != (batch,) or served_features.var_q.shape != (batch,):
            raise ValueError(f"served_features fields must have shape [{batch}]")
    for name, values in {**per_row, "request_temperature": request_temperature}.items():
        if values is not None and values.shape != (batch,):
            raise ValueError(f"{name} must have shape [{batch}], got {tuple(values.shape)}")
    return served_features


def policy_temperature(
    policy: TemperaturePolicy,
    step: Tensor,
    served_logits: Tensor | None = None,
    *,
    served_features: ServedRowFeatures | None = None,
    fixed: Tensor | None = None,
    t_min: Tensor | None = None,
    t_max: Tensor | None = None,
    request_temperature: Tensor | None = None,
    validate: bool = True,
) -> Tensor:
    """T* for each row under ``policy``: ``[B]`` float32 on ``step``'s device, in the bounds.

    Args:
        policy: the snapshot to apply (its lookup tables are cached per policy object and
            device, so pass the same object each step).
        step: ``[B]`` integer generation step of each row (0 = first generated token).
        served_logits: ``[B, V]`` served logits, read only when
            ``policy.reads_served_row`` (``fisher`` uses the served row's Var_q as its
            Var_p estimate, ``calibrated`` its entropy). Not modified.
        served_features: instead of ``served_logits``, the rows' precomputed
            :class:`~noisy_temp_server.temperature.stats.ServedRowFeatures` (``[B]`` fields),
            e.g. from stored calibration records. Give at most one of the two.
        fixed: ``[B]`` per-row T of the ``fixed`` rule, overriding ``policy.fixed_temperature``.
        t_min, t_max: ``[B]`` per-row bounds overriding ``policy.bounds`` (same contract as
            :class:`~noisy_temp_server.temperature.rules.TemperatureBounds`; not re-checked).
        request_temperature: ``[B]`` each row's request temperature (> 0), which picks the
            band of the ``calibrated`` table; None: every row at 1. Other rules ignore it.
        validate: check ``served_logits`` with ``check_logits`` (one device sync); with
            ``False`` a row with NaN statistics (NaN or +inf logits, or every token masked)
            gets T* = 1 instead of raising, under every rule that reads the served row.

    Raises ``ValueError`` for wrong shapes or missing served input, and
    :class:`~noisy_temp_server.temperature.stats.NonFiniteLogitsError` for bad served rows.
    """
    served_features = _checked_inputs(
        policy,
        step,
        served_logits,
        served_features,
        validate=validate,
        per_row={"fixed": fixed, "t_min": t_min, "t_max": t_max},
        request_temperature=request_temperature,
    )
    batch, device, rule = step.shape[0], step.device, policy.rule
    tables = _policy_tensors(policy, device)
    if rule is Rule.OFF:
        temperature = torch.ones(batch, device=device)
    elif rule is Rule.FIXED:
        temperature = (
            torch.full((batch,), policy.fixed_temperature, device=device)
            if fixed is None
            else fixed.to(torch.float32)
        )
    elif rule is Rule.SQRT:
        temperature = sqrt_temperature(tables.alpha_by_step[bucket_index(step, tables.step_edges)])
    elif rule is Rule.LINEAR:
        temperature = linear_temperature(
            tables.alpha_by_step[bucket_index(step, tables.step_edges)]
        )
    elif rule is Rule.SCHEDULE:
        temperature = schedule_temperature(step, policy.schedule_t_max, policy.schedule_beta)
    elif rule is Rule.FISHER:
        assert served_features is not None
        sigma2 = tables.sigma2_by_step[bucket_index(step, tables.step_edges)]
        var_q = served_features.var_q.to(device)
        temperature = fisher_temperature(sigma2, var_q, policy.fisher_var_floor)
    else:
        temperature = _calibrated_temperature(tables, step, served_features, request_temperature)
    lower = policy.bounds.t_min if t_min is None else t_min
    upper = policy.bounds.t_max if t_max is None else t_max
    return clamp_temperature(temperature.to(torch.float32), lower, upper)


def _calibrated_temperature(
    tables: _PolicyTensors,
    step: Tensor,
    served_features: ServedRowFeatures | None,
    request_temperature: Tensor | None,
) -> Tensor:
    """The calibrated table's T per row (before bounds): band x step bucket x entropy bucket.

    Without ``served_features`` the table does not depend on entropy (entropy bucket 0);
    without ``request_temperature`` every row is in the band of T_request = 1.
    """
    step_buckets = tables.calibrated_step_edges.shape[0]
    entropy_buckets = tables.calibrated_entropy_edges.shape[0]
    if request_temperature is None:
        request_temperature = torch.ones(step.shape[0], device=step.device)
    band = bucket_index(
        request_temperature.to(device=step.device, dtype=torch.float32),
        tables.calibrated_request_temperature_edges,
    )
    flat_index = (band * step_buckets + bucket_index(step, tables.calibrated_step_edges)) * (
        entropy_buckets
    )
    if served_features is None:
        return tables.calibrated_temperatures[flat_index]
    entropy = served_features.entropy.to(device=step.device, dtype=torch.float32)
    flat_index = flat_index + bucket_index(entropy, tables.calibrated_entropy_edges)
    # bucketize puts NaN in the last bucket; a row with no entropy gets NaN: T* = 1.
    return torch.where(entropy.isnan(), torch.nan, tables.calibrated_temperatures[flat_index])


@dataclass(frozen=True)
class StepTemperatures:
    """One request's T* as a function of its generation step alone (see
    :func:`step_temperatures`): for ``step`` in bucket ``i`` of ``step_edges``,
    ``T*(step) = clamp(scale[i] / sqrt(1 + beta * step), t_min, t_max)``.

    ``beta`` is 0 for every rule but ``schedule``; then ``scale`` is already within the bounds
    and T* is a table lookup. ``step_edges`` refines the policy's own ``step_edges`` (each of
    those is among them), so a caller can also tell which policy step bucket a bucket is in.
    """

    step_edges: tuple[int, ...]
    scale: tuple[float, ...]
    beta: float
    t_min: float
    t_max: float


def step_temperatures(
    policy: TemperaturePolicy,
    request_temperature: float,
    *,
    fixed: float | None = None,
    t_min: float | None = None,
    t_max: float | None = None,
) -> StepTemperatures | None:
    """Evaluate ``policy`` once for one request, when it is admitted, so that each generation
    step costs a table lookup; None when the policy reads the served row (``fisher``, a
    ``calibrated`` table with entropy buckets: :func:`policy_temperature` per step).

    Args:
        policy: the request's policy (rule overrides already applied).
        request_temperature: the request's own temperature (> 0; greedy requests are never
            tuned): it picks the band of a ``calibrated`` table.
        fixed, t_min, t_max: the request's ``fixed`` T and bounds (None: the policy's).

    The values are :func:`policy_temperature` at the first step of each bucket (bounds
    applied), so the two never disagree; ``schedule`` with ``beta`` > 0 keeps its closed form
    (``scale`` = its ``t_max``, ``beta`` its ``beta``: the caller applies the factor and the
    bounds per step), with ``beta`` = 0 it is a constant table like the others. Step buckets:
    the policy's ``step_edges``, merged with the calibrated table's for ``calibrated``.
    """
    if policy.reads_served_row:
        return None
    lower = policy.bounds.t_min if t_min is None else t_min
    upper = policy.bounds.t_max if t_max is None else t_max
    edges = policy.step_edges
    if policy.rule is Rule.CALIBRATED:
        edges = tuple(sorted({*edges, *policy.calibrated.step_edges}))
    if policy.rule is Rule.SCHEDULE and policy.schedule_beta > 0:
        scale = (policy.schedule_t_max,) * len(edges)
        return StepTemperatures(edges, scale, policy.schedule_beta, lower, upper)
    buckets = len(edges)
    temperature = policy_temperature(
        policy,
        torch.tensor(edges),
        fixed=None if fixed is None else torch.full((buckets,), fixed),
        t_min=torch.full((buckets,), lower),
        t_max=torch.full((buckets,), upper),
        request_temperature=torch.full((buckets,), request_temperature),
    )
    return StepTemperatures(edges, tuple(temperature.tolist()), 0.0, lower, upper)
