"""The temperature policy: an immutable, versioned, JSON-serialisable snapshot of "which rule
with which parameters", and :func:`policy_temperature`, the one implementation of rule -> T.

A policy is fixed when a request is admitted (it rides in ``SamplingParams.extra_args`` as the
compact JSON of :meth:`TemperaturePolicy.to_json`), so a request's T trace is reproducible.
Every field is validated on construction; :class:`PolicyValidationError` names the bad field.

Step buckets: ascending integer edges starting at 0, e.g. ``(0, 8, 32, 128, 512)``; bucket
``i`` covers steps ``[edge_i, edge_{i+1})`` and the last bucket is open-ended. Entropy buckets
of the calibrated table work the same way over the served row's entropy in nats, and so do its
request-temperature bands over the request's own temperature: the best T* depends on it (a
request at temperature 0.5 needs a larger T* than one at 1.2 on the same noisy pair), so the
calibrated table holds one band per request temperature it was calibrated at.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from noisy_temp_server.temperature import policy_checks as checks
from noisy_temp_server.temperature.policy_checks import PolicyValidationError
from noisy_temp_server.temperature.rules import (
    Rule,
    TemperatureBounds,
    clamp_temperature,
    fisher_temperature,
    linear_temperature,
    schedule_temperature,
    sqrt_temperature,
)
from noisy_temp_server.temperature.stats import ServedRowFeatures, served_row_features

__all__ = [
    "CalibratedTable",
    "PolicyValidationError",
    "StepTemperatures",
    "TemperaturePolicy",
    "bucket_index",
    "policy_temperature",
    "request_temperature_band_edges",
    "step_temperatures",
]


@dataclass(frozen=True)
class CalibratedTable:
    """T by (request-temperature band, step bucket, served-entropy bucket); entries may be below
    or above 1.

    ``temperatures[b][i][j]`` applies to a request whose temperature is in band ``b`` of
    ``request_temperature_edges``, at steps in step bucket ``i``, when its served row has
    entropy in entropy bucket ``j``. Request-temperature bands work like entropy buckets
    (ascending edges from 0; the last band is open-ended); one band, ``(0.0,)``, serves every
    request temperature alike. Sequences are normalised to tuples; validated on construction.
    """

    step_edges: tuple[int, ...] = (0,)
    entropy_edges: tuple[float, ...] = (0.0,)
    temperatures: tuple[tuple[tuple[float, ...], ...], ...] = (((1.0,),),)
    request_temperature_edges: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        step_edges = checks.step_edges("calibrated.step_edges", self.step_edges)
        entropy_edges = checks.entropy_edges("calibrated.entropy_edges", self.entropy_edges)
        band_edges = checks.entropy_edges(
            "calibrated.request_temperature_edges", self.request_temperature_edges
        )
        field = "calibrated.temperatures"
        expected = (
            f"a {len(band_edges)} x {len(step_edges)} x {len(entropy_edges)} table (request "
            "temperature bands x step buckets x entropy buckets) of finite numbers > 0"
        )
        bands = checks.sequence(field, self.temperatures, expected)
        if len(bands) != len(band_edges):
            raise checks.fail(field, expected, self.temperatures)
        table = []
        for band in bands:
            rows = checks.sequence(field, band, expected)
            if len(rows) != len(step_edges):
                raise checks.fail(field, expected, self.temperatures)
            try:
                table.append(
                    tuple(
                        checks.per_bucket(field, row, len(entropy_edges), positive=True)
                        for row in rows
                    )
                )
            except PolicyValidationError:
                raise checks.fail(field, expected, self.temperatures) from None
        object.__setattr__(self, "step_edges", step_edges)
        object.__setattr__(self, "entropy_edges", entropy_edges)
        object.__setattr__(self, "temperatures", tuple(table))
        object.__setattr__(self, "request_temperature_edges", band_edges)

    @property
    def reads_entropy(self) -> bool:
        """Whether some (band, step bucket) holds different T for different entropies."""
        return any(len(set(row)) > 1 for band in self.temperatures for row in band)

    @classmethod
    def by_request_temperature(
        cls, request_temperatures: Sequence[float], temperatures: Sequence[float]
    ) -> CalibratedTable:
        """One T per request temperature (ascending, distinct), the same at every step and
        entropy: band i of `request_temperature_band_edges` serves `temperatures[i]`."""
        if len(temperatures) != len(request_temperatures):
            raise PolicyValidationError(
                f"calibrated.temperatures: {len(temperatures)} for "
                f"{len(request_temperatures)} request temperatures"
            )
        return cls(
            temperatures=tuple(((t,),) for t in temperatures),
            request_temperature_edges=request_temperature_band_edges(request_temperatures),
        )


def request_temperature_band_edges(request_temperatures: Sequence[float]) -> tuple[float, ...]:
    """Band edges (from 0) with each of the ascending `request_temperatures` in its own band:
    the boundaries are the midpoints between neighbours."""
    return (0.0, *((a + b) / 2 for a, b in itertools.pairwise(request_temperatures)))


_JSON_KEYS = (
    "version",
    "rule",
    "t_min",
    "t_max",
    "fixed_temperature",
    "step_edges",
    "alpha_by_step",
    "sigma2_by_step",
    "fisher_var_floor",
    "schedule_t_max",
    "schedule_beta",
    "calibrated",
    "bias",
)
_CALIBRATED_KEYS = ("step_edges", "entropy_edges", "temperatures", "request_temperature_edges")


@dataclass(frozen=True)
class TemperaturePolicy:
    """An immutable, versioned snapshot of the temperature rule and all its parameters.

    Attributes:
        version: >= 0; increases with each published policy.
        rule: the :class:`~noisy_temp_server.temperature.rules.Rule` to apply (a name is
            accepted and converted).
        bounds: T* is clamped into these.
        fixed_temperature: T of the ``fixed`` rule (> 0).
        step_edges: step bucket edges for ``alpha_by_step`` and ``sigma2_by_step``.
        alpha_by_step: alpha = sigma2 / tau2 per step bucket (>= 0), for ``sqrt``/``linear``.
        sigma2_by_step: logit noise variance per step bucket (>= 0), for ``fisher``.
        fisher_var_floor: lower bound on Var_q in the ``fisher`` rule (> 0).
        schedule_t_max, schedule_beta: T(step) = t_max / sqrt(1 + beta * step) (``schedule``).
        calibrated: the table of the ``calibrated`` rule.
        bias: the sha256 (64 lowercase hex digits) of a per-token logit bias b added to the
            served logits before the temperature, softmax((z~ + b) / T) (`temperature.bias`),
            on top of any rule; None: no bias. Only the hash travels with the policy; the
            vector (float32, one entry per vocabulary token) is a file the engine loads once
            (`temperature.bias.bias_file_name`).

    Sequences are normalised to tuples and numbers to float/int, so equal policies compare
    (and hash) equal and round-trip exactly through JSON.
    """

    version: int = 0
    rule: Rule = Rule.OFF
    bounds: TemperatureBounds = dataclasses.field(default_factory=TemperatureBounds)
    fixed_temperature: float = 1.0
    step_edges: tuple[int, ...] = (0,)
    alpha_by_step: tuple[float, ...] = (0.0,)
    sigma2_by_step: tuple[float, ...] = (0.0,)
    fisher_var_floor: float = 1.0
    schedule_t_max: float = 1.0
    schedule_beta: float = 0.0
    calibrated: CalibratedTable = dataclasses.field(default_factory=CalibratedTable)
    bias: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise checks.fail("version", "an integer >= 0", self.version)
        rule = checks.rule(self.rule)
        if not isinstance(self.bounds, TemperatureBounds):
            raise checks.fail("bounds", "a TemperatureBounds", self.bounds)
        if not isinstance(self.calibrated, CalibratedTable):
            raise checks.fail("calibrated", "a CalibratedTable", self.calibrated)
        edges = checks.step_edges("step_edges", self.step_edges)
        values = {
            "rule": rule,
            "fixed_temperature": checks.number(
                "fixed_temperature", self.fixed_temperature, positive=True
            ),
            "step_edges": edges,
            "alpha_by_step": checks.per_bucket(
                "alpha_by_step", self.alpha_by_step, len(edges), positive=False
            ),
            "sigma2_by_step": checks.per_bucket(
                "sigma2_by_step", self.sigma2_by_step, len(edges), positive=False
            ),
            "fisher_var_floor": checks.number(
                "fisher_var_floor", self.fisher_var_floor, positive=True
            ),
            "schedule_t_max": checks.number("schedule_t_max", self.schedule_t_max, positive=True),
            "schedule_beta": checks.number("schedule_beta", self.schedule_beta),
            "bias": None if self.bias is None else checks.sha256("bias", self.bias),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def identity(cls) -> TemperaturePolicy:
        """Version 0, rule ``off``: T* = 1 for every row."""
        return cls()

    @property
    def reads_served_row(self) -> bool:
        """Whether evaluating this policy needs the served row's statistics (a softmax pass).

        ``fisher`` always does. ``calibrated`` does only when its table tells entropy buckets
        apart, i.e. some (band, step bucket) holds different T for different entropies; an
        all-ones (not yet fitted) or entropy-independent table is evaluated from the step (and
        the request temperature) alone.
        """
        if self.rule is Rule.FISHER:
            return True
        return self.rule is Rule.CALIBRATED and self.calibrated.reads_entropy

    def serving_bias(
        self, sha256: str, band_temperatures: Mapping[float, float]
    ) -> TemperaturePolicy:
        """This policy serving the bias `sha256` with its T at each request temperature,
        `band_temperatures` {T_r: T} (T_r = 1 among them): rule `fixed` at that T when every
        band has the same T, else rule `calibrated` with one band per request temperature
        (`CalibratedTable.by_request_temperature`); `fixed_temperature` is the T_r = 1 one
        either way (what `nts_rule=fixed` serves with the bias)."""
        temperatures = tuple(band_temperatures[t_r] for t_r in sorted(band_temperatures))
        served = dataclasses.replace(
            self, bias=sha256, fixed_temperature=band_temperatures[1.0], rule=Rule.FIXED
        )
        if len(set(temperatures)) == 1:
            return served
        table = CalibratedTable.by_request_temperature(sorted(band_temperatures), temperatures)
        return dataclasses.replace(served, rule=Rule.CALIBRATED, calibrated=table)

    def with_overrides(
        self,
        rule: Rule | str | None = None,
        fixed_temperature: float | None = None,
        t_min: float | None = None,
        t_max: float | None = None,
    ) -> TemperaturePolicy:
        """A copy with a request's overrides applied (``None`` keeps the policy's value).

        The version is kept: the overrides are part of the request, not a new policy. Raises
        :class:`PolicyValidationError` for a bad override.
        """
        bounds = self.bounds
        if t_min is not None or t_max is not None:
            bounds = _bounds(
                self.bounds.t_min if t_min is None else t_min,
                self.bounds.t_max if t_max is None else t_max,
            )
        return dataclasses.replace(
            self,
            rule=self.rule if rule is None else checks.rule(rule),
            fixed_temperature=(
                self.fixed_temperature if fixed_temperature is None else fixed_temperature
            ),
            bounds=bounds,
        )

    def to_json(self) -> str:
        """Compact JSON: fields equal to the identity policy's are left out (version and rule
        always stay). ``from_json(p.to_json()) == p`` exactly."""
        encoded = _encode(self)
        defaults = _encode(TemperaturePolicy())
        compact = {
            key: value
            for key, value in encoded.items()
            if key in ("version", "rule") or value != defaults[key]
        }
        return json.dumps(compact, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> TemperaturePolicy:
        """Parse and validate :meth:`to_json` output; missing fields take the identity values.

        Raises :class:`PolicyValidationError` for invalid JSON, a non-object, unknown fields,
        NaN/Infinity, or any invalid field (named in the message).
        """
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (json.JSONDecodeError, TypeError) as error:
            raise PolicyValidationError(f"policy is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise PolicyValidationError(f"policy JSON must be an object, got {type(data).__name__}")
        _reject_unknown("policy", data, _JSON_KEYS)
        defaults = TemperaturePolicy()
        calibrated = defaults.calibrated
        if "calibrated" in data:
            table = data["calibrated"]
            if not isinstance(table, dict):
                raise checks.fail("calibrated", "an object", table)
            _reject_unknown("policy field 'calibrated'", table, _CALIBRATED_KEYS)
            calibrated = CalibratedTable(
                step_edges=table.get("step_edges", calibrated.step_edges),
                entropy_edges=table.get("entropy_edges", calibrated.entropy_edges),
                temperatures=table.get("temperatures", calibrated.temperatures),
                request_temperature_edges=table.get(
                    "request_temperature_edges", calibrated.request_temperature_edges
                ),
            )
        return cls(
            version=data.get("version", defaults.version),
            rule=data.get("rule", defaults.rule),
            bounds=_bounds(
                data.get("t_min", defaults.bounds.t_min), data.get("t_max", defaults.bounds.t_max)
            ),
            fixed_temperature=data.get("fixed_temperature", defaults.fixed_temperature),
            step_edges=data.get("step_edges", defaults.step_edges),
            alpha_by_step=data.get("alpha_by_step", defaults.alpha_by_step),
            sigma2_by_step=data.get("sigma2_by_step", defaults.sigma2_by_step),
            fisher_var_floor=data.get("fisher_var_floor", defaults.fisher_var_floor),
            schedule_t_max=data.get("schedule_t_max", defaults.schedule_t_max),
            schedule_beta=data.get("schedule_beta", defaults.schedule_beta),
            calibrated=calibrated,
            bias=data.get("bias", defaults.bias),
        )


def _bounds(t_min: object, t_max: object) -> TemperatureBounds:
    try:
        return TemperatureBounds(t_min, t_max)  # type: ignore[arg-type]
    except ValueError as error:
        raise PolicyValidationError(f"policy bounds: {error}") from None


def _reject_constant(name: str) -> Any:
    raise PolicyValidationError(f"policy JSON must not contain {name}; numbers must be finite")


def _reject_unknown(where: str, data: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PolicyValidationError(
            f"{where} has unknown field(s) {unknown}; known fields: {', '.join(known)}"
        )


def _encode(policy: TemperaturePolicy) -> dict[str, Any]:
    table = policy.calibrated
    return {
        "version": policy.version,
        "rule": policy.rule.value,
        "t_min": float(policy.bounds.t_min),
        "t_max": float(policy.bounds.t_max),
        "fixed_temperature": policy.fixed_temperature,
        "step_edges": list(policy.step_edges),
        "alpha_by_step": list(policy.alpha_by_step),
        "sigma2_by_step": list(policy.sigma2_by_step),
        "fisher_var_floor": policy.fisher_var_floor,
        "schedule_t_max": policy.schedule_t_max,
        "schedule_beta": policy.schedule_beta,
        "calibrated": {
            "step_edges": list(table.step_edges),
            "entropy_edges": list(table.entropy_edges),
            "temperatures": [[list(row) for row in band] for band in table.temperatures],
            "request_temperature_edges": list(table.request_temperature_edges),
        },
        "bias": policy.bias,
    }


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


def _build_policy_tensors(policy: TemperaturePolicy, device: torch.device) -> _PolicyTensors:
    def values(data: Sequence[float]) -> Tensor:
        return torch.tensor(data, dtype=torch.float32, device=device)

    table = policy.calibrated
    return _PolicyTensors(
        step_edges=torch.tensor(policy.step_edges, dtype=torch.int64, device=device),
        alpha_by_step=values(policy.alpha_by_step),
        sigma2_by_step=values(policy.sigma2_by_step),
        calibrated_step_edges=torch.tensor(table.step_edges, dtype=torch.int64, device=device),
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
    if step.dim() != 1:
        raise ValueError(f"step must have shape [batch], got {tuple(step.shape)}")
    batch, device, rule = step.shape[0], step.device, policy.rule
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
    per_row_inputs = (
        ("fixed", fixed),
        ("t_min", t_min),
        ("t_max", t_max),
        ("request_temperature", request_temperature),
    )
    for name, per_row in per_row_inputs:
        if per_row is not None and per_row.shape != (batch,):
            raise ValueError(f"{name} must have shape [{batch}], got {tuple(per_row.shape)}")

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
