"""The `nts` object of a response: what temperature a choice (and a whole request) ran at.

A choice's summary joins its per-step T* from the trace channel with its policy: the rule
applied (`off` for a request that is not tuned), the pinned policy's version, its mean α over
the generated steps and the T* statistics, and the correction (per-token bias) its logits
got. The request's summary combines its choices'.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from noisy_temp_server.engine_contract.request_args import LogitCorrection, RequestTuning
from noisy_temp_server.engine_contract.trace_channel import TraceReport
from noisy_temp_server.server.response_bodies import NtsSummary
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

__all__ = ["choice_summary", "combine_summaries", "mean_alpha", "reported_rule"]


def reported_rule(tuning: RequestTuning | None) -> str:
    """The rule a request reports: the one applied, `off` when it is not tuned."""
    return tuning.rule.value if tuning is not None else Rule.OFF.value


def mean_alpha(policy: TemperaturePolicy, steps: int) -> float | None:
    """Mean α of `policy` over generation steps 0..steps-1 (None for no step)."""
    if steps <= 0:
        return None
    edges, alphas = policy.step_edges, policy.alpha_by_step
    total = 0.0
    for bucket, low in enumerate(edges):
        high = edges[bucket + 1] if bucket + 1 < len(edges) else steps
        total += alphas[bucket] * max(0, min(high, steps) - low)
    return total / steps


def choice_summary(
    policy: TemperaturePolicy,
    tuning: RequestTuning | None,
    trace: Sequence[float],
    *,
    steps: int,
    with_trace: bool,
    report: TraceReport | None = None,
    correction: LogitCorrection | None = None,
    adapter: str | None = None,
) -> NtsSummary:
    """The `nts` object of one choice of `steps` generated tokens under the pinned `policy`,
    whose per-step T* are `trace` (possibly incomplete or empty). The T statistics come from
    the engine's `report` when it has some, else from `trace` (None if nothing arrived); the
    trace itself is included when `with_trace`; `correction`: the per-token bias the choice
    was served with (None: none), reported by its sha256 (`bias`);
    `adapter`: the sha256 of the compensation adapter it was served with (None: none)."""
    values = [_float32_digits(t) for t in trace]
    if report is not None and report.t_mean is not None:
        stats = (report.t_mean, report.t_min, report.t_max)
        t_mean, t_min, t_max = (None if t is None else _float32_digits(t) for t in stats)
    else:
        t_mean = statistics.fmean(values) if values else None
        t_min = min(values) if values else None
        t_max = max(values) if values else None
    return NtsSummary(
        rule=reported_rule(tuning),
        policy_version=policy.version,
        alpha=mean_alpha(policy, steps) if tuning is not None else None,
        t_mean=t_mean,
        t_min=t_min,
        t_max=t_max,
        steps=steps,
        trace=values if with_trace else None,
        adapter=adapter,
        bias=None if correction is None else correction.bias,
    )


def _float32_digits(value: float) -> float:
    """T* is float32 in the engine: 7 significant digits."""
    return float(f"{value:.7g}")


def combine_summaries(
    policy: TemperaturePolicy,
    tuning: RequestTuning | None,
    summaries: Sequence[NtsSummary],
    correction: LogitCorrection | None = None,
    adapter: str | None = None,
) -> NtsSummary:
    """The request-level `nts` object over all choices: step-weighted means of α and T*, the
    extreme T*; it carries the per-step trace (when asked) only for a single choice, otherwise
    each choice has its own; `correction` and `adapter` as in `choice_summary` (the
    request's)."""
    steps = sum(s.steps for s in summaries)
    means = [(s.t_mean, s.steps) for s in summaries if s.t_mean is not None and s.steps]
    lows = [s.t_min for s in summaries if s.t_min is not None]
    highs = [s.t_max for s in summaries if s.t_max is not None]
    alphas = [s.alpha * s.steps for s in summaries if s.alpha is not None]
    weight = sum(count for _, count in means)
    return NtsSummary(
        rule=reported_rule(tuning),
        policy_version=policy.version,
        alpha=sum(alphas) / steps if alphas and steps else None,
        t_mean=sum(mean * count for mean, count in means) / weight if weight else None,
        t_min=min(lows, default=None),
        t_max=max(highs, default=None),
        steps=steps,
        trace=summaries[0].trace if len(summaries) == 1 else None,
        adapter=adapter,
        bias=None if correction is None else correction.bias,
    )
