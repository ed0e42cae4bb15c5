"""The online side's metrics: the policy in force and the shadow scorer's work.

`OnlineMetrics` creates them on an injected `registry` (the server's `ApiMetrics` composes it
on its own; see `server.metrics` for the multiprocess mode they are served in). Gauges use the
`mostrecent` multiprocess mode (the value last set by any process). Labels are bounded:
step-bucket labels, `one`/`served`, drop reasons, scoreboard quantile levels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from noisy_temp_server.online.policy_source import describe_policy
from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = ["OnlineMetrics"]

_KL_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
_SCORE_SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

_SCOREBOARD_GAUGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("positions", "positions in the window", ()),
    ("kld_mean", "mean KL(clean || served) in nats", ()),
    ("kld_stderr", "standard error of the mean KL (clustered by request)", ()),
    ("kld_quantile", "percentiles of the KL", ("quantile",)),
    ("same_top_ratio", "share of positions where served and clean agree on the top token", ()),
    ("delta_p_mean", "mean change of the clean top token's probability", ()),
    ("delta_p_rms", "RMS change of the clean top token's probability", ()),
    ("ppl_ratio", "perplexity ratio PPL(served) / PPL(clean)", ()),
)
"""`nts_scoreboard_*` gauges: (name, what it is, labels besides `temperature`)."""
_SCOREBOARD_FIELDS = {
    "positions": "positions",
    "kld_mean": "kld_mean",
    "kld_stderr": "kld_stderr",
    "same_top_ratio": "same_top_rate",
    "delta_p_mean": "delta_p_mean",
    "delta_p_rms": "delta_p_rms",
    "ppl_ratio": "ppl_ratio",
}
"""Gauge name -> `ScoreboardResult` field, for the gauges without extra labels."""
_SCOREBOARD_TEMPERATURES = {"T=1": "one", "T*": "served"}


class OnlineMetrics:
    """The policy gauges (`nts_policy_version`, `nts_alpha`, `nts_sigma2`,
    `nts_estimator_last_update_timestamp_seconds`), the shadow scorer's counters and histograms
    (`nts_shadow_*`) and the live scoreboard's gauges (`nts_scoreboard_*`), created on
    `registry`; `clock` gives the publication time of a policy (Unix seconds)."""

    def __init__(
        self, registry: CollectorRegistry, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._clock = clock
        self._add_policy_gauges(registry)
        self._add_shadow_metrics(registry)
        self.scoreboard = {
            name: Gauge(
                f"nts_scoreboard_{name}",
                f"Live KL scoreboard of recent shadow-scored positions: {description}, at T = 1 "
                "(one) and at the T* the engine applied (served), against the clean model at "
                "the request's temperature.",
                ["temperature", *extra],
                registry=registry,
                multiprocess_mode="mostrecent",
            )
            for name, description, extra in _SCOREBOARD_GAUGES
        }

    def _add_policy_gauges(self, registry: CollectorRegistry) -> None:
        self.alpha = Gauge(
            "nts_alpha",
            "Current alpha = sigma2/tau2 estimate of the policy in force, by step bucket.",
            ["step_bucket"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.sigma2 = Gauge(
            "nts_sigma2",
            "Current logit-noise variance estimate of the policy in force, by step bucket.",
            ["step_bucket"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.policy_version = Gauge(
            "nts_policy_version",
            "Version of the temperature policy given to new requests.",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.estimator_last_update = Gauge(
            "nts_estimator_last_update_timestamp_seconds",
            "Unix time at which the online estimator last published a policy.",
            registry=registry,
            multiprocess_mode="mostrecent",
        )

    def _add_shadow_metrics(self, registry: CollectorRegistry) -> None:
        self.shadow_kl = Histogram(
            "nts_shadow_kl_nats",
            "Per scored position KL(clean || served), the clean model at the request's "
            "temperature, at T = 1 (one) and at the served T* (served).",
            ["temperature"],
            buckets=_KL_BUCKETS,
            registry=registry,
        )
        self.shadow_requests_scored = Counter(
            "nts_shadow_requests_scored",
            "Finished requests scored by the shadow scorer.",
            registry=registry,
        )
        self.shadow_requests_dropped = Counter(
            "nts_shadow_requests_dropped",
            "Sampled finished requests the shadow scorer did not score.",
            ["reason"],
            registry=registry,
        )
        self.shadow_tokens_scored = Counter(
            "nts_shadow_tokens_scored",
            "Completion positions scored by the shadow scorer.",
            registry=registry,
        )
        self.shadow_score_seconds = Histogram(
            "nts_shadow_score_seconds",
            "Wall time to score one request (clean and served passes).",
            buckets=_SCORE_SECONDS_BUCKETS,
            registry=registry,
        )
        for reason in ("queue_full", "error"):
            self.shadow_requests_dropped.labels(reason=reason)
        for temperature in ("one", "served"):
            self.shadow_kl.labels(temperature=temperature)

    def observe_scored(
        self, positions: int, seconds: float, kld: Mapping[str, Sequence[float]]
    ) -> None:
        """Count one request scored in `seconds` over `positions` positions, and observe the
        KL of each position by temperature label (`one`, `served`) in `nts_shadow_kl_nats`."""
        self.shadow_requests_scored.inc()
        self.shadow_tokens_scored.inc(positions)
        self.shadow_score_seconds.observe(seconds)
        for temperature, values in kld.items():
            histogram = self.shadow_kl.labels(temperature=temperature)
            for value in values:
                histogram.observe(value)

    def publish_policy(self, policy: TemperaturePolicy) -> None:
        """Set the policy gauges to `policy`, the one now given to new requests (its α and σ²
        by step bucket label, `describe_policy`), published now (`clock`). This is the
        shadow scorer's `on_policy` callback, and the server calls it once at startup."""
        described = describe_policy(policy)
        self.policy_version.set(policy.version)
        for bucket, value in described["alpha_by_step_bucket"].items():
            self.alpha.labels(step_bucket=bucket).set(value)
        for bucket, value in described["sigma2_by_step_bucket"].items():
            self.sigma2.labels(step_bucket=bucket).set(value)
        self.estimator_last_update.set(self._clock())

    def publish_scoreboard(self, results: Mapping[str, Mapping[str, Any]]) -> None:
        """Set the `nts_scoreboard_*` gauges from `LiveScoreboard.result()` (labels `T=1` and
        `T*` become `temperature="one"` / `"served"`; quantiles keep their level, e.g.
        `"99.9"`; a null value, i.e. unknown, is set as +Inf). A label with too few positions
        sets only `positions`."""
        for label, result in results.items():
            temperature = _SCOREBOARD_TEMPERATURES[label]
            self.scoreboard["positions"].labels(temperature=temperature).set(result["positions"])
            if "error" in result:
                continue
            for name, field in _SCOREBOARD_FIELDS.items():
                value = result[field]
                self.scoreboard[name].labels(temperature=temperature).set(
                    math.inf if value is None else value
                )
            quantiles = self.scoreboard["kld_quantile"]
            for level, value in result["kld_percentiles"].items():
                quantiles.labels(temperature=temperature, quantile=level).set(value)
