"""The API process's metrics (see the metrics table in docs/architecture.md).

`ApiMetrics` creates every API-side metric on an injected `registry`, so tests build a fresh
`CollectorRegistry` and read values with `get_sample_value`. In production the process runs in
Prometheus' multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before `prometheus_client` is first
imported, see `server.engine`): every metric of every process, ours and vLLM's, is written to
that directory, and `/metrics` serves `serving_registry()`, a registry whose only collector is a
`MultiProcessCollector` over it. The metric objects are then registered on a private registry
that is never served, so nothing is reported twice.

Gauges use the `mostrecent` multiprocess mode (the value last set by any process). Labels are
bounded: step-bucket labels, rule names, `one`/`served`, drop reasons, route templates, the one
adapter a server serves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from noisy_temp_server.engine_contract.trace_wire import DROP_REASONS
from noisy_temp_server.online.metrics import OnlineMetrics

__all__ = [
    "ApiMetrics",
    "HttpMetricsMiddleware",
    "serving_registry",
]

_LOGGER = logging.getLogger(__name__)

_TEMPERATURE_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
    """Every API-side metric of the contract, created on `registry`: the HTTP layer's, the
    per-request T*, the capture's dropped rows, and the online side's (`online`, an
    `OnlineMetrics`: the policy gauges, the shadow scorer's and the live scoreboard's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.online = OnlineMetrics(registry)
        self.request_temperature_mean = Histogram(
            "nts_request_temperature_mean",
            "Per-request mean T* (1 for greedy and tuning-off requests).",
            ["rule"],
            buckets=_TEMPERATURE_BUCKETS,
            registry=registry,
        )
        self.capture_dropped_rows = Counter(
            "nts_capture_dropped_rows",
            "Served-logit rows of shadow-sampled requests the capture dropped, by reason "
            "(rows_per_step, speculative, queue_full: in the engine; buffer_full: here).",
            ["reason"],
            registry=registry,
        )
        self.http_requests = Counter(
            "nts_http_requests",
            "HTTP requests by method, route template and status code.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.adapter_info = Gauge(
            "nts_adapter_info",
            "The compensation adapter served: 1 with the path in force (folded into the "
            "weights, lora: vLLM's LoRA, none) and the adapter's sha256 (16 hex digits; empty "
            "for none).",
            ["path", "sha256"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.http_request_duration = Histogram(
            "nts_http_request_duration_seconds",
            "HTTP request latency (to the end of the response body) by route template.",
            ["route"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.capture_dropped_rows.labels(reason=reason)

    def publish_adapter(self, path: str, sha256: str | None) -> None:
        """Set `nts_adapter_info` to the adapter path in force (one series per server: a
        server's adapter never changes while it runs)."""
        self.adapter_info.labels(path=path, sha256=(sha256 or "")[:16]).set(1)


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
