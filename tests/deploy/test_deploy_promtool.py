"""promtool (Debian's prometheus package) on the Prometheus config, the alerting rules and every
PromQL expression of the dashboard and the rules; and unit tests of each alert on synthetic
series (`promtool test rules`): it fires when it should, and not for the look-alike cases.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.prometheus

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NTS = {"job": "noisy-temp-server"}


def promtool_run(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *map(str, args)], capture_output=True, text=True, check=False, timeout=120
    )


def test_prometheus_config_is_valid(promtool: str) -> None:
    result = promtool_run(promtool, "check", "config", DEPLOY / "prometheus" / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerting_rules_are_valid(promtool: str) -> None:
    result = promtool_run(promtool, "check", "rules", DEPLOY / "prometheus" / "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


def test_every_promql_expression_parses(
    promtool: str, all_expressions: list[Any], tmp_path: Path
) -> None:
    """Each expression goes into a recording rule; promtool parses and type-checks them all."""
    names = {f"check:expression_{i}": e for i, e in enumerate(all_expressions)}
    rules = [{"record": name, "expr": e.expr} for name, e in names.items()]
    path = tmp_path / "expressions.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "expressions", "rules": rules}]}))

    result = promtool_run(promtool, "check", "rules", path)

    output = result.stdout + result.stderr
    failing = [f"{e.where}: {e.expr}" for name, e in names.items() if f'"{name}"' in output]
    assert result.returncode == 0, "\n".join([output, *failing])
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    selector = ",".join(f'{k}="{v}"' for k, v in {**NTS, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def alert_case(
    eval_time: str,
    alertname: str,
    input_series: list[dict[str, str]],
    firing: list[dict[str, str]],
) -> dict[str, Any]:
    """A promtool rule test: `firing` are the label sets expected at `eval_time`."""
    return {
        "interval": "1m",
        "input_series": input_series,
        "alert_rule_test": [
            {
                "eval_time": eval_time,
                "alertname": alertname,
                "exp_alerts": [{"exp_labels": labels} for labels in firing],
            }
        ],
    }


STEP = "nts_step_temperature"
KL = "nts_shadow_kl_nats"

ALERT_CASES = [
    alert_case(
        "10m",
        "NtsTargetDown",
        [
            series("up", {"instance": "a"}, "0x20"),
            series("up", {"instance": "b"}, "1x20"),
        ],
        [{"severity": "critical", "instance": "a", **NTS}],
    ),
    alert_case(
        "50m",
        "NtsEstimatorStalled",
        [
            # a: never updated while 100 positions/min are scored -> stalled
            series("nts_estimator_last_update_timestamp_seconds", {"instance": "a"}, "0x60"),
            series("nts_shadow_tokens_scored_total", {"instance": "a"}, "0+100x60"),
            # b: publishes every minute (the value is the sample's own time)
            series("nts_estimator_last_update_timestamp_seconds", {"instance": "b"}, "0+60x60"),
            series("nts_shadow_tokens_scored_total", {"instance": "b"}, "0+100x60"),
            # c: old policy but no traffic to learn from
            series("nts_estimator_last_update_timestamp_seconds", {"instance": "c"}, "0x60"),
            series("nts_shadow_tokens_scored_total", {"instance": "c"}, "0x60"),
        ],
        [{"severity": "warning", "instance": "a"}],
    ),
    alert_case(
        "40m",
        "NtsShadowQueueDropping",
        [
            series(
                "nts_shadow_requests_dropped_total",
                {"instance": "a", "reason": "queue_full"},
                "0+5x60",
            ),
            series("nts_shadow_requests_scored_total", {"instance": "a"}, "0+5x60"),
            series(
                "nts_shadow_requests_dropped_total",
                {"instance": "b", "reason": "queue_full"},
                "0+1x60",
            ),
            series("nts_shadow_requests_scored_total", {"instance": "b"}, "0+50x60"),
        ],
        [{"severity": "warning", "instance": "a"}],
    ),
    alert_case(
        "40m",
        "NtsShadowScoringErrors",
        [
            series(
                "nts_shadow_requests_dropped_total", {"instance": "a", "reason": "error"}, "0+1x60"
            ),
            series(
                "nts_shadow_requests_dropped_total", {"instance": "b", "reason": "error"}, "0x60"
            ),
        ],
        [{"severity": "warning", "instance": "a"}],
    ),
    alert_case(
        "40m",
        "NtsTemperaturePinnedHigh",
        [
            # a: 80% of steps above 3.0 -> pinned
            series(
                f"{STEP}_count", {"instance": "a", "rule": "sqrt", "step_bucket": "0-7"}, "0+10x60"
            ),
            series(
                f"{STEP}_bucket",
                {"instance": "a", "rule": "sqrt", "step_bucket": "0-7", "le": "3.0"},
                "0+2x60",
            ),
            # b: all steps at or below 3.0
            series(
                f"{STEP}_count", {"instance": "b", "rule": "sqrt", "step_bucket": "0-7"}, "0+10x60"
            ),
            series(
                f"{STEP}_bucket",
                {"instance": "b", "rule": "sqrt", "step_bucket": "0-7", "le": "3.0"},
                "0+10x60",
            ),
            # c: a client's fixed T = 4 is its own choice
            series(
                f"{STEP}_count", {"instance": "c", "rule": "fixed", "step_bucket": "0-7"}, "0+10x60"
            ),
            series(
                f"{STEP}_bucket",
                {"instance": "c", "rule": "fixed", "step_bucket": "0-7", "le": "3.0"},
                "0x60",
            ),
        ],
        [{"severity": "warning", "instance": "a", "rule": "sqrt"}],
    ),
    alert_case(
        "40m",
        "NtsTemperaturePinnedLow",
        [
            series(
                f"{STEP}_count",
                {"instance": "a", "rule": "calibrated", "step_bucket": "8-31"},
                "0+10x60",
            ),
            series(
                f"{STEP}_bucket",
                {"instance": "a", "rule": "calibrated", "step_bucket": "8-31", "le": "0.25"},
                "0+9x60",
            ),
            series(
                f"{STEP}_count",
                {"instance": "b", "rule": "calibrated", "step_bucket": "8-31"},
                "0+10x60",
            ),
            series(
                f"{STEP}_bucket",
                {"instance": "b", "rule": "calibrated", "step_bucket": "8-31", "le": "0.25"},
                "0+1x60",
            ),
        ],
        [{"severity": "warning", "instance": "a", "rule": "calibrated"}],
    ),
    alert_case(
        "50m",
        "NtsKlGainNegative",
        [
            # a: served mean KL 0.2 > 0.1 at T = 1 over 3000 positions -> worse
            series(f"{KL}_sum", {"instance": "a", "temperature": "served"}, "0+20x60"),
            series(f"{KL}_count", {"instance": "a", "temperature": "served"}, "0+100x60"),
            series(f"{KL}_sum", {"instance": "a", "temperature": "one"}, "0+10x60"),
            series(f"{KL}_count", {"instance": "a", "temperature": "one"}, "0+100x60"),
            # b: tuning helps
            series(f"{KL}_sum", {"instance": "b", "temperature": "served"}, "0+5x60"),
            series(f"{KL}_count", {"instance": "b", "temperature": "served"}, "0+100x60"),
            series(f"{KL}_sum", {"instance": "b", "temperature": "one"}, "0+10x60"),
            series(f"{KL}_count", {"instance": "b", "temperature": "one"}, "0+100x60"),
            # c: worse, but only 150 positions in 30 min: too few to tell
            series(f"{KL}_sum", {"instance": "c", "temperature": "served"}, "0+2x60"),
            series(f"{KL}_count", {"instance": "c", "temperature": "served"}, "0+5x60"),
            series(f"{KL}_sum", {"instance": "c", "temperature": "one"}, "0+1x60"),
            series(f"{KL}_count", {"instance": "c", "temperature": "one"}, "0+5x60"),
        ],
        [{"severity": "warning", "instance": "a"}],
    ),
]


def run_alert_case(
    promtool: str, alert_groups: list[dict[str, Any]], case: dict[str, Any], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    # promtool compares annotations too; they are templates, checked by `check rules` above.
    stripped = [
        {
            **group,
            "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in group["rules"]],
        }
        for group in alert_groups
    ]
    rules = tmp_path / "alerts.yml"
    rules.write_text(yaml.safe_dump({"groups": stripped}))
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(
        yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [case]})
    )
    return promtool_run(promtool, "test", "rules", tests)


@pytest.mark.parametrize(
    "case", ALERT_CASES, ids=[c["alert_rule_test"][0]["alertname"] for c in ALERT_CASES]
)
def test_alert_fires_only_when_it_should(
    promtool: str, alert_groups: list[dict[str, Any]], case: dict[str, Any], tmp_path: Path
) -> None:
    result = run_alert_case(promtool, alert_groups, case, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_tests_can_fail(
    promtool: str, alert_groups: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The harness notices a wrong expectation (instance b of the KL case does not fire)."""
    case = ALERT_CASES[-1]
    (rule_test,) = case["alert_rule_test"]
    wrong_labels = {"severity": "warning", "instance": "b"}
    wrong = {
        **case,
        "alert_rule_test": [{**rule_test, "exp_alerts": [{"exp_labels": wrong_labels}]}],
    }
    assert run_alert_case(promtool, alert_groups, wrong, tmp_path).returncode != 0
