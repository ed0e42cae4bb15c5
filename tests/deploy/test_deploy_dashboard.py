"""The Grafana dashboard and the alerting rules against the metrics contract: every metric they
use exists (docs/architecture.md for nts_*, vLLM's own loggers for vllm:*), the panels the
issue asks for are there, and template variables are defined and used.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from noisy_temp_server.step.engine_metrics import STEP_TEMPERATURE_BUCKETS
from noisy_temp_server.temperature.rules import TemperatureBounds

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}
_METRIC = re.compile(r"\b(?:nts_\w+|vllm:[\w:]+)")


def contract_metrics() -> dict[str, str]:
    """nts_* metric -> type, from the metrics table of docs/architecture.md."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(nts_\w+)` \| (counter|gauge|histogram) \|", text, flags=re.MULTILINE)
    assert len(rows) >= 10, "docs/architecture.md: metrics table not found"
    return dict(rows)


def vllm_metrics() -> dict[str, str]:
    """vllm:* metric -> type, read from the installed vLLM's Prometheus stat logger."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None
    assert spec.origin is not None
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    found = re.findall(
        r'self\._(gauge|counter|histogram)_cls\(\s*name="(vllm:[^"]+)"', loggers.read_text()
    )
    assert len(found) >= 20, f"{loggers}: metric definitions not found"
    return {name: kind for kind, name in found}


def known_series() -> set[str]:
    """Series names as exposed (prometheus_client appends `_total` to a counter once)."""
    return {
        name.removesuffix("_total") + suffix if kind == "counter" else name + suffix
        for name, kind in (contract_metrics() | vllm_metrics()).items()
        for suffix in SERIES_SUFFIXES[kind]
    }


def test_every_metric_used_exists(all_expressions: list[Any]) -> None:
    known = known_series()
    used = set()
    for expression in all_expressions:
        for name in _METRIC.findall(expression.expr):
            assert name in known, f"{expression.where}: unknown series {name}"
            used.add(name)
    assert len(used) >= 20


def test_dashboard_has_the_panels_the_issue_asks_for(
    dashboard_panel_targets: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    def panels_using(pattern: str) -> list[dict[str, Any]]:
        return [p for p, t in dashboard_panel_targets if re.search(pattern, t["expr"])]

    assert panels_using(r"\bnts_alpha\b")
    assert panels_using(r"\bnts_sigma2\b")
    assert any("by (step_bucket)" in t["expr"] for _, t in dashboard_panel_targets)
    heatmaps = [
        p for p in panels_using(r"nts_request_temperature_mean_bucket") if p["type"] == "heatmap"
    ]
    assert heatmaps, "T* per request needs a heatmap of nts_request_temperature_mean buckets"
    for panel in heatmaps:
        assert all(t["format"] == "heatmap" for t in panel["targets"])
        assert panel["options"]["calculate"] is False
    assert any(
        "step_bucket" in t["expr"] and "nts_step_temperature" in t["expr"]
        for _, t in dashboard_panel_targets
    )
    kl = " ".join(
        t["expr"] for _, t in dashboard_panel_targets if "nts_shadow_kl_nats" in t["expr"]
    )
    for series in ("nts_shadow_kl_nats_sum", "nts_shadow_kl_nats_count"):
        assert series in kl
    assert 'temperature="one"' in kl
    assert 'temperature="served"' in kl
    assert panels_using(r"\bnts_policy_version\b")
    for statistic in ("kld_mean", "kld_stderr", "kld_quantile", "same_top_ratio"):
        assert panels_using(rf"\bnts_scoreboard_{statistic}\b"), statistic
    for statistic in ("delta_p_mean", "delta_p_rms", "ppl_ratio"):
        assert panels_using(rf"\bnts_scoreboard_{statistic}\b"), statistic
    for vllm_series in (
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ):
        assert panels_using(re.escape(vllm_series)), vllm_series


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "noisy-temp-server"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= set(variables)
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_query_is_filtered_by_the_template_variables(
    dashboard_panel_targets: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    for panel, target in dashboard_panel_targets:
        expr = target["expr"]
        for selector in re.findall(r"(?:nts_\w+|vllm:[\w:]+)\{([^}]*)\}", expr):
            assert 'instance=~"$instance"' in selector, f"{panel['title']}: {expr}"
        for selector in re.findall(r"vllm:[\w:]+\{([^}]*)\}", expr):
            assert 'model_name=~"$model"' in selector, f"{panel['title']}: {expr}"
        assert not re.search(r"(?:nts_\w+|vllm:[\w:]+)(?![\w{:])", expr), (
            f"{panel['title']}: a series without a label filter in {expr}"
        )


def test_pinned_temperature_alerts_use_real_bucket_edges(alert_rules: list[dict[str, Any]]) -> None:
    """The alerts' `le` values are edges of nts_step_temperature: the bottom one is the default
    lower bound, the top one the edge just below the default upper bound."""
    bounds = TemperatureBounds()
    edges = sorted(STEP_TEMPERATURE_BUCKETS)
    assert bounds.t_min in edges, "a bucket edge must sit at the default lower bound"
    assert bounds.t_max in edges, "a bucket edge must sit at the default upper bound"
    by_name = {rule["alert"]: rule["expr"] for rule in alert_rules}
    (low,) = re.findall(r'le="([^"]+)"', by_name["NtsTemperaturePinnedLow"])
    (high,) = re.findall(r'le="([^"]+)"', by_name["NtsTemperaturePinnedHigh"])
    # prometheus_client writes bucket edges as Python floats: 3.0 -> "3.0".
    assert float(low) == bounds.t_min == edges[0]
    assert low == repr(bounds.t_min)
    assert high == repr(edges[edges.index(bounds.t_max) - 1])


def test_alerts_have_severity_and_annotations(alert_rules: list[dict[str, Any]]) -> None:
    names = {rule["alert"] for rule in alert_rules}
    assert {
        "NtsEstimatorStalled",
        "NtsShadowQueueDropping",
        "NtsTemperaturePinnedHigh",
        "NtsTemperaturePinnedLow",
        "NtsKlGainNegative",
    } <= names
    for rule in alert_rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]
