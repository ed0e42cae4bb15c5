"""The API process's metrics (see the metrics table in docs/architecture.md).

`ApiMetrics` creates every API-side metric on an injected `registry`, so tests build a fresh
`CollectorRegistry` and read values with `get_sample_value`. In production the process runs in
Prometheus' multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before `prometheus_client` is first
imported, see `server.engine`): every metric of every process, ours and vLLM's, is written to
that directory, and `/metrics` serves `serving_registry()`, a registry whose only collector is a
`MultiProcessCollector` over it. The metric objects are then registered on a private registry
that is never served, so nothing is reported twice.

Gauges use the `mostrecent` multiprocess mode (the value last set by any process). Labels are
bounded: step-bucket labels, rule names, `one`/`served`, drop reasons, route templates.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from noisy_temp_server.engine_contract.trace_wire import DROP_REASONS

__all__ = [
    "ApiMetrics",
    "HttpMetricsMiddleware",
    "serving_registry",
]

_LOGGER = logging.getLogger(__name__)

_TEMPERATURE_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)
_KL_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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


def serving_registry() -> CollectorRegistry:
    """The registry `/metrics` serves in multiprocess mode (all processes' metric files).

    Raises RuntimeError when `PROMETHEUS_MULTIPROC_DIR` is not set.
    """
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        raise RuntimeError(
            "PROMETHEUS_MULTIPROC_DIR is not set; call server.engine.prepare_environment() "
            "before anything imports prometheus_client."
        )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


class ApiMetrics:
    """Every API-side metric of the contract, created on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.request_temperature_mean = Histogram(
            "nts_request_temperature_mean",
            "Per-request mean T* (1 for greedy and tuning-off requests).",
            ["rule"],
            buckets=_TEMPERATURE_BUCKETS,
            registry=registry,
        )
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
        self.capture_dropped_rows = Counter(
            "nts_capture_dropped_rows",
            "Served-logit rows of shadow-sampled requests the capture dropped, by reason "
            "(rows_per_step, speculative, queue_full: in the engine; buffer_full: here).",
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
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.http_requests = Counter(
            "nts_http_requests",
            "HTTP requests by method, route template and status code.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.http_request_duration = Histogram(
            "nts_http_request_duration_seconds",
            "HTTP request latency (to the end of the response body) by route template.",
            ["route"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
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
        for reason in ("queue_full", "error"):
            self.shadow_requests_dropped.labels(reason=reason)
        for temperature in ("one", "served"):
            self.shadow_kl.labels(temperature=temperature)
        for reason in DROP_REASONS:
            self.capture_dropped_rows.labels(reason=reason)

    def publish_policy(
        self,
        version: int,
        alpha_by_bucket: Mapping[str, float],
        sigma2_by_bucket: Mapping[str, float],
        published_at: float | None = None,
    ) -> None:
        """Set the policy gauges to the policy now given to new requests."""
        self.policy_version.set(version)
        for bucket, value in alpha_by_bucket.items():
            self.alpha.labels(step_bucket=bucket).set(value)
        for bucket, value in sigma2_by_bucket.items():
            self.sigma2.labels(step_bucket=bucket).set(value)
        if published_at is not None:
            self.estimator_last_update.set(published_at)

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


def _route_template(scope: Scope) -> str:
    """The matching route's path template (bounded), or `unmatched`."""
    for route in scope["app"].router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "unmatched"))
    return "unmatched"


_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HttpMetricsMiddleware:
    """Pure ASGI middleware counting HTTP requests by method (any method outside the standard
    seven is `other`: the client chooses it, and a label must not grow without bound), route
    template and the status sent (500 when the app raised before sending one) and timing each
    until its ASGI call returns, so a streamed response's duration covers its whole body.

    A client gone while its response is sent ends the call here: on servers of ASGI spec 2.4
    and later a failed `send` surfaces as Starlette's `ClientDisconnect`, which is counted as
    499 (nginx's "client closed request"), logged at INFO and not raised on, so no server logs
    it as a fault. (Under spec 2.3, uvicorn's, Starlette's own disconnect listener ends the
    stream instead and the status counted is the one sent.) A call cancelled before it sent a
    status (the server shutting down, a timeout) is counted as 499 too, and the cancellation
    goes on: no response was made, and no fault of the app's. Pure ASGI, not Starlette's
    `BaseHTTPMiddleware`, so `send` reaches the response unwrapped and no task group stands
    between the handler and its cancellation.
    """

    def __init__(self, app: ASGIApp, *, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        route = _route_template(scope)
        method = scope["method"] if scope["method"] in _KNOWN_METHODS else "other"
        status: str | None = None  # the status sent, None until then

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_recording_status)
        except ClientDisconnect:  # sending found the client gone: nobody to answer, no fault
            status = "499"
            _LOGGER.info("The client of %s %s disconnected", method, route)
        except asyncio.CancelledError:
            status = status or "499"
            raise
        finally:
            self.metrics.http_requests.labels(method, route, status or "500").inc()
            self.metrics.http_request_duration.labels(route).observe(time.perf_counter() - start)
