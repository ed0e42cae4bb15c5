"""The status page's server side: what it reads from the registry, the KL history, and its
routes (the page without a key, the data behind it). The page itself runs in a browser in
tests/e2e/test_dashboard_*.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from noisy_temp_server.server.dashboard import (
    HistogramTotals,
    KlHistory,
    dashboard_router,
    shadow_kl_totals,
    step_temperature_summary,
)
from noisy_temp_server.server.errors import OpenAIError, install_error_handlers
from noisy_temp_server.server.metrics import ApiMetrics
from noisy_temp_server.step.engine_metrics import StepTemperatureMetrics

KEY = "secret"


def _registry() -> tuple[CollectorRegistry, ApiMetrics, StepTemperatureMetrics]:
    registry = CollectorRegistry()
    return registry, ApiMetrics(registry), StepTemperatureMetrics(registry)


def test_step_temperature_summary_is_the_mean_by_rule_and_bucket_in_step_order() -> None:
    registry, _, steps = _registry()
    for label, value in zip(["32+", "0-7", "0-7", "8-31"], [2.0, 1.0, 1.5, 1.2], strict=True):
        steps.histogram.labels(step_bucket=label, rule="sqrt").observe(value)
    for label, value in zip(["0-7"], [1.3], strict=True):
        steps.histogram.labels(step_bucket=label, rule="fixed").observe(value)
    summary = step_temperature_summary(registry.collect())
    assert [(r["rule"], r["step_bucket"], r["step_start"], r["steps"]) for r in summary] == [
        ("fixed", "0-7", 0, 1),
        ("sqrt", "0-7", 0, 2),
        ("sqrt", "8-31", 8, 1),
        ("sqrt", "32+", 32, 1),
    ]
    assert [r["t_mean"] for r in summary] == pytest.approx([1.3, 1.25, 1.2, 2.0])


def test_shadow_kl_totals_are_zero_before_any_scoring_then_count_and_sum() -> None:
    registry, metrics, _ = _registry()
    assert shadow_kl_totals(registry.collect()) == {
        "one": HistogramTotals(),
        "served": HistogramTotals(),
    }
    for value in (0.1, 0.3):
        metrics.online.shadow_kl.labels(temperature="one").observe(value)
    totals = shadow_kl_totals(registry.collect())
    assert totals["one"].count == 2
    assert totals["one"].mean == pytest.approx(0.2)
    assert totals["served"].mean is None


def _totals(one: tuple[float, float], served: tuple[float, float]) -> dict[str, HistogramTotals]:
    return {"one": HistogramTotals(*one), "served": HistogramTotals(*served)}


def test_kl_history_points_are_means_over_the_positions_since_the_previous_point() -> None:
    history = KlHistory(max_points=10, min_interval_s=1.0)
    history.sample(100.0, _totals((2, 1.0), (2, 0.5)))
    points = history.sample(102.0, _totals((6, 3.0), (6, 1.3)))
    assert [p["time"] for p in points] == [100.0, 102.0]
    assert points[0]["kl_one"] == pytest.approx(0.5)
    assert points[1]["kl_one"] == pytest.approx(2.0 / 4)
    assert points[1]["kl_served"] == pytest.approx(0.8 / 4)
    assert points[1]["positions_one"] == 4
    quiet = history.sample(104.0, _totals((6, 3.0), (6, 1.3)))[-1]
    assert (quiet["kl_one"], quiet["kl_served"], quiet["positions_one"]) == (None, None, 0)


def test_kl_history_samples_at_most_once_per_interval_and_keeps_the_newest_points() -> None:
    history = KlHistory(max_points=3, min_interval_s=1.0)
    history.sample(0.0, _totals((1, 1.0), (1, 1.0)))
    assert len(history.sample(0.5, _totals((5, 9.0), (5, 9.0)))) == 1
    for second in range(1, 6):
        points = history.sample(float(second), _totals((5, 9.0), (5, 9.0)))
    assert [p["time"] for p in points] == [3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="max_points"):
        KlHistory(max_points=0, min_interval_s=1.0)


@pytest.fixture
def client() -> TestClient:
    registry, metrics, steps = _registry()
    for label, value in zip(["0-7"], [1.25], strict=True):
        steps.histogram.labels(step_bucket=label, rule="sqrt").observe(value)
    metrics.online.shadow_kl.labels(temperature="one").observe(0.4)

    async def require_key(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            raise OpenAIError("bad key", status_code=401, code="invalid_api_key")

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(dashboard_router(registry, require_key, clock=lambda: 1000.0))
    return TestClient(app)


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_the_page_is_served_without_a_key_and_loads_only_its_own_assets(
    client: TestClient, path: str
) -> None:
    response = client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "http://" not in page
    assert "https://" not in page  # no CDN: the page works offline
    for asset in ("uPlot.iife.min.js", "uPlot.min.css", "dashboard.js", "dashboard.css"):
        assert f"/dashboard/assets/{asset}" in page
        assert client.get(f"/dashboard/assets/{asset}").status_code == 200


def test_assets_outside_the_list_are_not_found(client: TestClient) -> None:
    for name in ("dashboard.html", "..%2Fdashboard.py", "nope.js"):
        response = client.get(f"/dashboard/assets/{name}")
        assert response.status_code == 404
        assert "error" in response.json()


def test_the_data_needs_the_key_and_reports_the_registry(client: TestClient) -> None:
    refused = client.get("/v1/nts/dashboard")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    body = client.get("/v1/nts/dashboard", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert body["time"] == 1000.0
    assert body["step_temperature"] == [
        {"rule": "sqrt", "step_bucket": "0-7", "step_start": 0, "steps": 1, "t_mean": 1.25}
    ]
    assert body["shadow_kl"] == {
        "one": {"positions": 1, "mean": pytest.approx(0.4)},
        "served": {"positions": 0, "mean": None},
    }
    assert [p["kl_one"] for p in body["kl_history"]] == [pytest.approx(0.4)]
