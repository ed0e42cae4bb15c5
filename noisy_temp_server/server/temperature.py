"""From the policy in force and a request's `nts_*` keys to the engine's flat keys and back to
the response's `nts` summary.

`resolve_request_temperature` runs at admission: server defaults (settings) fill the keys the
client left out, the one parser (`vllm_plugin.request_args.parse_request_args`) validates them,
and the policy snapshot is pinned into the request (`nts_policy`), so the engine applies exactly
the policy the summary describes, whatever the estimator publishes meanwhile.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from noisy_temp_server.server.protocol import NtsSummary
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.metrics import step_bucket_labels
from noisy_temp_server.vllm_plugin.request_args import (
    RequestTemperatureArgs,
    ResolvedRequest,
    parse_request_args,
    resolve_request,
)
from noisy_temp_server.vllm_plugin.trace_channel import TraceReport

__all__ = [
    "PolicySource",
    "RequestTemperature",
    "StaticPolicySource",
    "describe_policy",
    "resolve_request_temperature",
]


class PolicySource(Protocol):
    """Where new requests get their policy (`estimation.online.OnlineEstimator` is one)."""

    def current_policy(self) -> TemperaturePolicy: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StaticPolicySource:
    """A policy that never changes (a profile, or the identity when there is no estimator)."""

    policy: TemperaturePolicy
    origin: str

    def current_policy(self) -> TemperaturePolicy:
        return self.policy

    def status(self) -> dict[str, Any]:
        return {"enabled": False, "origin": self.origin}


def describe_policy(policy: TemperaturePolicy) -> dict[str, Any]:
    """Version, rule and α/σ² by step bucket label (for `/v1/nts/status` and the gauges)."""
    labels = step_bucket_labels(policy.step_edges)
    return {
        "policy_version": policy.version,
        "rule": policy.rule.value,
        "alpha_by_step_bucket": dict(zip(labels, policy.alpha_by_step, strict=True)),
        "sigma2_by_step_bucket": dict(zip(labels, policy.sigma2_by_step, strict=True)),
    }


@dataclass(frozen=True)
class RequestTemperature:
    """One admitted request's temperature settings: what goes to the engine and what the
    response reports.

    `resolved` is what the engine's processor will apply (the same `resolve_request`), None for
    greedy requests, `nts_tune=false` and the `off` rule: the processor leaves those alone, and
    they report T* = 1 with rule `off`.
    """

    args: RequestTemperatureArgs
    policy: TemperaturePolicy
    resolved: ResolvedRequest | None

    @property
    def tuned(self) -> bool:
        return self.resolved is not None

    @property
    def rule(self) -> str:
        return self.resolved.rule.value if self.resolved is not None else Rule.OFF.value

    def extra_args(self, trace_id: str) -> dict[str, Any]:
        """The flat keys for one choice's `SamplingParams.extra_args`."""
        if not self.tuned:
            return dataclasses.replace(self.args, trace_id=None).to_extra_args()
        return dataclasses.replace(self.args, trace_id=trace_id).to_extra_args()

    def mean_alpha(self, steps: int) -> float | None:
        """Mean α of the policy over generation steps 0..steps-1 (None for no step)."""
        if steps <= 0:
            return None
        edges, alphas = self.policy.step_edges, self.policy.alpha_by_step
        total = 0.0
        for bucket, low in enumerate(edges):
            high = edges[bucket + 1] if bucket + 1 < len(edges) else steps
            total += alphas[bucket] * max(0, min(high, steps) - low)
        return total / steps

    def summary(
        self, trace: Sequence[float], *, steps: int, report: TraceReport | None = None
    ) -> NtsSummary:
        """The `nts` object of one choice of `steps` generated tokens whose per-step T* are
        `trace` (possibly incomplete or empty). The T statistics come from the engine's
        `report` when it has some, else from `trace` (None if nothing arrived)."""
        values = [_float32_digits(t) for t in trace]
        if report is not None and report.t_mean is not None:
            stats = (report.t_mean, report.t_min, report.t_max)
            t_mean, t_min, t_max = (None if t is None else _float32_digits(t) for t in stats)
        else:
            t_mean = statistics.fmean(values) if values else None
            t_min = min(values) if values else None
            t_max = max(values) if values else None
        return NtsSummary(
            rule=self.rule,
            policy_version=self.policy.version,
            alpha=self.mean_alpha(steps) if self.tuned else None,
            t_mean=t_mean,
            t_min=t_min,
            t_max=t_max,
            steps=steps,
            trace=values if self.args.trace else None,
        )

    def combine(self, summaries: Sequence[NtsSummary]) -> NtsSummary:
        """The request-level `nts` object over all choices; it carries the per-step trace (when
        asked) only for a single choice, otherwise each choice has its own."""
        steps = sum(s.steps for s in summaries)
        means = [(s.t_mean, s.steps) for s in summaries if s.t_mean is not None and s.steps]
        lows = [s.t_min for s in summaries if s.t_min is not None]
        highs = [s.t_max for s in summaries if s.t_max is not None]
        alphas = [s.alpha * s.steps for s in summaries if s.alpha is not None]
        weight = sum(count for _, count in means)
        return NtsSummary(
            rule=self.rule,
            policy_version=self.policy.version,
            alpha=sum(alphas) / steps if alphas and steps else None,
            t_mean=sum(mean * count for mean, count in means) / weight if weight else None,
            t_min=min(lows, default=None),
            t_max=max(highs, default=None),
            steps=steps,
            trace=summaries[0].trace if len(summaries) == 1 else None,
        )


def _float32_digits(value: float) -> float:
    """T* is float32 in the engine: 7 significant digits."""
    return float(f"{value:.7g}")


def _with_defaults(client_args: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    merged = dict(client_args)
    defaults = {
        "nts_rule": settings.default_rule,
        "nts_t": settings.default_t,
        "nts_t_min": settings.default_t_min,
        "nts_t_max": settings.default_t_max,
    }
    for key, value in defaults.items():
        if value is not None and key not in merged:
            merged[key] = value
    if "nts_rule" in client_args and "nts_t" not in client_args:
        merged.pop("nts_t", None)  # the server's fixed T belongs to the server's default rule
    return merged


def resolve_request_temperature(
    policy: TemperaturePolicy,
    client_args: Mapping[str, Any],
    settings: Settings,
    *,
    request_temperature: float,
) -> RequestTemperature:
    """Validate the request's `nts_*` keys over the server defaults and pin `policy`.

    `request_temperature`: the request's own temperature (0 for greedy). Raises ValueError
    (HTTP 400) naming the bad key.
    """
    args = parse_request_args(_with_defaults(client_args, settings))
    pinned = dataclasses.replace(args, policy_json=policy.to_json())
    return RequestTemperature(
        args=pinned, policy=policy, resolved=resolve_request(pinned, request_temperature)
    )
