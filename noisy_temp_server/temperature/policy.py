"""The temperature policy: an immutable, versioned, JSON-serialisable snapshot of "which rule
with which parameters" (evaluated on rows by `temperature.policy_eval`).

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

from noisy_temp_server.temperature import policy_checks as checks
from noisy_temp_server.temperature.policy_checks import PolicyValidationError
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds

__all__ = [
    "CalibratedTable",
    "PolicyValidationError",
    "TemperaturePolicy",
    "request_temperature_band_edges",
    "step_bucket_labels",
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


def step_bucket_labels(edges: Sequence[int]) -> tuple[str, ...]:
    """Label of each step bucket given ascending edges starting at 0: bucket ``i`` covers
    ``[edges[i], edges[i+1])``, e.g. ``(0, 8, 32)`` -> ``("0-7", "8-31", "32+")``."""
    inner = [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(edges)]
    return (*inner, f"{edges[-1]}+")


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
            served logits before the temperature, softmax((z~ + b) / T) (`correction.bias`),
            on top of any rule; None: no bias. Only the hash travels with the policy; the
            vector (float32, one entry per vocabulary token) is a file the engine loads once
            (`correction.files.bias_file_name`).

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
        self,
        sha256: str,
        band_temperatures: Mapping[float, float],
    ) -> TemperaturePolicy:
        """This policy serving the bias `sha256` with its T at each request temperature,
        `band_temperatures` {T_r: T} (T_r = 1 among them): rule `fixed` at that T when every
        band has the same T, else rule `calibrated` with one band per request temperature
        (`CalibratedTable.by_request_temperature`); `fixed_temperature` is the T_r = 1 one
        either way (what `nts_rule=fixed` serves with the bias)."""
        temperatures = tuple(band_temperatures[t_r] for t_r in sorted(band_temperatures))
        served = dataclasses.replace(
            self,
            bias=sha256,
            fixed_temperature=band_temperatures[1.0],
            rule=Rule.FIXED,
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

        Raises :class:`PolicyValidationError` for invalid JSON, a non-object, unknown fields
        (a head map, which earlier versions could name, among them: it was removed, and such a
        policy is refused with a line that says so), NaN/Infinity, or any invalid field (named
        in the message).
        """
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (json.JSONDecodeError, TypeError) as error:
            raise PolicyValidationError(f"policy is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise PolicyValidationError(f"policy JSON must be an object, got {type(data).__name__}")
        if "head_map" in data:
            raise PolicyValidationError(
                "policy names a head map (head_map), which noisy-temp-server no longer serves; "
                "recalibrate with `noisy-temp-server calibrate` for a policy without one"
            )
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
