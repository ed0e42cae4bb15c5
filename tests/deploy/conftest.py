"""Shared fixtures of the deployment tests: the repository's deploy files, parsed, and the
PromQL expressions they contain (Grafana variables substituted so Prometheus can parse them).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
DASHBOARD_PATH = DEPLOY_DIR / "grafana" / "dashboards" / "noisy-temp-server.json"
ALERTS_PATH = DEPLOY_DIR / "prometheus" / "alerts.yml"

# What Grafana puts in place of its built-in variables, for parsing only.
GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class PromqlExpression:
    """One PromQL expression of the deploy files, ready for Prometheus."""

    where: str  # e.g. "dashboard panel 'Queue' target A" or "alert NtsKlGainNegative"
    expr: str


def dashboard_variable_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """A parseable stand-in for every template variable of `dashboard` and Grafana builtin."""
    values = dict(GRAFANA_BUILTINS)
    for variable in dashboard["templating"]["list"]:
        kind = variable["type"]
        if kind == "interval":
            values[variable["name"]] = variable["query"].split(",")[0]
        elif kind in {"query", "custom"}:
            values[variable["name"]] = ".*"
        else:
            values[variable["name"]] = variable["name"]
    return values


def substitute_variables(expr: str, values: dict[str, str], where: str) -> str:
    """`expr` with each `$name` / `${name}` replaced; an unknown variable is an error."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise AssertionError(f"{where}: unknown variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def dashboard_targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query target of the dashboard, rows' nested panels included."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner, target


def dashboard_expressions(dashboard: dict[str, Any]) -> list[PromqlExpression]:
    values = dashboard_variable_values(dashboard)
    found = []
    for panel, target in dashboard_targets(dashboard):
        where = f"dashboard panel {panel['title']!r} target {target['refId']}"
        found.append(PromqlExpression(where, substitute_variables(target["expr"], values, where)))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            assert match, f"variable {variable['name']}: expected label_values(...), got {query!r}"
            found.append(PromqlExpression(f"dashboard variable {variable['name']}", match[1]))
    return found


def alert_expressions(groups: list[dict[str, Any]]) -> list[PromqlExpression]:
    return [
        PromqlExpression(f"alert {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in groups
        for rule in group["rules"]
    ]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


@pytest.fixture(scope="session")
def dashboard_panel_targets(
    dashboard: dict[str, Any],
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return list(dashboard_targets(dashboard))


@pytest.fixture(scope="session")
def alert_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(ALERTS_PATH.read_text())["groups"]


@pytest.fixture(scope="session")
def alert_rules(alert_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in alert_groups for rule in group["rules"]]


@pytest.fixture(scope="session")
def all_expressions(
    dashboard: dict[str, Any], alert_groups: list[dict[str, Any]]
) -> list[PromqlExpression]:
    return dashboard_expressions(dashboard) + alert_expressions(alert_groups)


def _debian_prometheus_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found. Install Debian's prometheus package (`scripts/setup.sh --dev`, "
            "or `apt-get install -y prometheus`), or deselect these tests with "
            "-m 'not prometheus'."
        )
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _debian_prometheus_tool("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _debian_prometheus_tool("prometheus")
