"""The status page: a self-contained HTML page with live plots, and the JSON it needs that only
the Prometheus registry holds.

Routes of `dashboard_router`:

- `GET /` and `GET /dashboard`: the page (`static/dashboard.html`), served without a key: it
  holds no data. It asks for the API key once (kept in the tab's `sessionStorage`, sent as
  `Authorization: Bearer`, never in a URL) and polls `/health`, `/v1/nts/status` and
  `/v1/nts/dashboard` every few seconds.
- `GET /dashboard/assets/{name}`: the page's script and style and the vendored uPlot
  (`static/vendor/uplot`, see its README), from a fixed list of files.
- `GET /v1/nts/dashboard` (behind the API key when one is configured): the T* applied by step
  bucket and rule (`nts_step_temperature`, written by the engine process), the shadow scorer's
  KL to the clean model at T = 1 and at the served T (`nts_shadow_kl_nats`), and a bounded
  history of that KL over time.

The KL history is a server-side ring buffer sampled when `/v1/nts/dashboard` is read (at most
once per `min_sample_interval_s`): each point is the mean KL of the positions scored since the
previous point (None when none were), so it shows what recent traffic looks like, not a running
mean. History starts when the first page opens; a server with no page open keeps none.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from noisy_temp_server.server.errors import OpenAIError

__all__ = [
    "HistogramTotals",
    "KlHistory",
    "dashboard_router",
    "histogram_totals",
    "shadow_kl_totals",
    "step_temperature_summary",
]

STEP_TEMPERATURE_METRIC = "nts_step_temperature"
SHADOW_KL_METRIC = "nts_shadow_kl_nats"
_SHADOW_TEMPERATURES = ("one", "served")
_STATIC = "static"
# URL name -> (file under static/, media type): the only files the asset route serves.
_ASSETS = {
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css; charset=utf-8"),
    "uPlot-LICENSE.txt": ("vendor/uplot/LICENSE", "text/plain; charset=utf-8"),
}


@dataclass(frozen=True)
class HistogramTotals:
    """Observation count and sum of one labelled histogram child."""

    count: float = 0.0
    total: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def minus(self, earlier: HistogramTotals) -> HistogramTotals:
        return HistogramTotals(self.count - earlier.count, self.total - earlier.total)


def histogram_totals(
    families: Iterable[Metric], name: str
) -> dict[tuple[tuple[str, str], ...], HistogramTotals]:
    """Count and sum of every child of histogram `name` among `families` (what a registry's
    `collect()` yields), keyed by its sorted label pairs. Works on a plain registry and on the
    multiprocess serving registry (whose collector sums the processes' files). Children never
    observed are absent or zero."""
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    sums: dict[tuple[tuple[str, str], ...], float] = {}
    for family in families:
        if family.name != name:
            continue
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            if sample.name == f"{name}_count":
                counts[key] = counts.get(key, 0.0) + sample.value
            elif sample.name == f"{name}_sum":
                sums[key] = sums.get(key, 0.0) + sample.value
    return {key: HistogramTotals(count, sums.get(key, 0.0)) for key, count in counts.items()}


def _bucket_start(label: str) -> int:
    """The first step of a step bucket label (`"8-31"` -> 8, `"32+"` -> 32)."""
    return int(label.rstrip("+").split("-")[0])


def step_temperature_summary(families: Iterable[Metric]) -> list[dict[str, Any]]:
    """Mean T* applied per (rule, step bucket) since the server started, ordered by rule then
    bucket start: `{"rule", "step_bucket", "step_start", "steps", "t_mean"}` (`steps`: tuned
    rows observed). Children with no observation are left out."""
    rows = []
    for key, totals in histogram_totals(families, STEP_TEMPERATURE_METRIC).items():
        labels = dict(key)
        if totals.count <= 0 or "step_bucket" not in labels:
            continue
        rows.append(
            {
                "rule": labels.get("rule", ""),
                "step_bucket": labels["step_bucket"],
                "step_start": _bucket_start(labels["step_bucket"]),
                "steps": int(totals.count),
                "t_mean": totals.mean,
            }
        )
    return sorted(rows, key=lambda row: (row["rule"], row["step_start"]))


def shadow_kl_totals(families: Iterable[Metric]) -> dict[str, HistogramTotals]:
    """Cumulative KL(clean || served) totals of the shadow scorer by `one` / `served`."""
    found = histogram_totals(families, SHADOW_KL_METRIC)
    return {
        temperature: found.get((("temperature", temperature),), HistogramTotals())
        for temperature in _SHADOW_TEMPERATURES
    }


class KlHistory:
    """A bounded history of the shadow KL: one point per `sample` call at least
    `min_interval_s` after the previous one, holding the mean KL of the positions scored in
    between. Thread-safe."""

    def __init__(self, max_points: int, min_interval_s: float) -> None:
        if max_points < 1:
            raise ValueError(f"max_points must be >= 1, got {max_points}")
        self._points: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_points)
        self._min_interval_s = min_interval_s
        self._last_time: float | None = None
        self._last_totals = {t: HistogramTotals() for t in _SHADOW_TEMPERATURES}
        self._lock = threading.Lock()

    def sample(self, now: float, totals: dict[str, HistogramTotals]) -> list[dict[str, Any]]:
        """Record a point for `totals` (cumulative, by `one`/`served`) unless the last point is
        younger than `min_interval_s`; return the history, oldest first. Each point:
        `{"time", "kl_one", "kl_served", "positions_one", "positions_served"}`."""
        with self._lock:
            if self._last_time is None or now - self._last_time >= self._min_interval_s:
                point: dict[str, Any] = {"time": now}
                for temperature in _SHADOW_TEMPERATURES:
                    new = totals[temperature].minus(self._last_totals[temperature])
                    point[f"kl_{temperature}"] = new.mean
                    point[f"positions_{temperature}"] = int(new.count)
                self._points.append(point)
                self._last_time = now
                self._last_totals = dict(totals)
            return list(self._points)


def _read_static(path: str) -> bytes:
    return (resources.files(__package__) / _STATIC / path).read_bytes()


def _totals_json(totals: HistogramTotals) -> dict[str, Any]:
    return {"positions": int(totals.count), "mean": totals.mean}


def dashboard_router(
    registry: CollectorRegistry,
    require_api_key: Callable[..., Awaitable[None]],
    *,
    history_points: int = 720,
    min_sample_interval_s: float = 1.0,
    clock: Callable[[], float] = time.time,
) -> APIRouter:
    """The status page's routes (see the module docstring).

    `registry`: what `/metrics` serves (in production the multiprocess registry, which also
    holds the engine's `nts_step_temperature`). `require_api_key`: the app's key dependency,
    applied to the JSON route only. `history_points`: how many KL history points are kept
    (720 at the page's 5 s refresh: one hour). Static files are read once, here.
    """
    page = _read_static("dashboard.html")
    assets = {name: (_read_static(path), media) for name, (path, media) in _ASSETS.items()}
    history = KlHistory(history_points, min_sample_interval_s)
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/assets/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            raise OpenAIError(f"No dashboard asset `{name}`.", status_code=404)
        body, media_type = assets[name]
        return Response(body, media_type=media_type, headers={"Cache-Control": "max-age=300"})

    @router.get(
        "/v1/nts/dashboard", dependencies=[Depends(require_api_key)], include_in_schema=False
    )
    async def dashboard_data() -> JSONResponse:
        families = list(registry.collect())
        kl_totals = shadow_kl_totals(families)
        now = clock()
        return JSONResponse(
            {
                "time": now,
                "step_temperature": step_temperature_summary(families),
                "shadow_kl": {t: _totals_json(kl_totals[t]) for t in _SHADOW_TEMPERATURES},
                "kl_history": history.sample(now, kl_totals),
            }
        )

    return router
