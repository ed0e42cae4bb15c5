"""End to end: a real Prometheus (Debian's package) on loopback, configured from
deploy/prometheus/, scrapes a running `noisy-temp-server serve` (tiny model pair on CPU) after
some traffic; every dashboard expression returns data and every alerting rule evaluates
without error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from server_helpers import free_port, running_server, stop, wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.vllm]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVER_START_TIMEOUT_S = 600
SHADOW_TIMEOUT_S = 300
SCRAPE_INTERVAL = "1s"


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `noisy-temp-server serve` on loopback: a tiny random Llama served (seed 1) against
    another as the clean model (seed 0), every finished request shadow-scored, and the
    estimator publishing after a few positions."""
    from tiny_model import build_tiny_llama  # noqa: PLC0415

    work = tmp_path_factory.mktemp("live-server")
    clean = build_tiny_llama(work / "clean", seed=0)
    served = build_tiny_llama(work / "served", seed=1)
    port = free_port()
    env = {
        **os.environ,
        "NTS_HOST": "127.0.0.1",
        "NTS_PORT": str(port),
        "NTS_CACHE_DIR": str(work / "cache"),
        "NTS_SERVED_MODEL": str(served),
        "NTS_SERVED_MODEL_NAME": "tiny",
        "NTS_CLEAN_MODEL": str(clean),
        "NTS_SHADOW_FRACTION": "1.0",
        "NTS_SHADOW_MIN_POSITIONS": "32",
        "NTS_KV_CACHE_GIB": "1",
        "NTS_MAX_MODEL_LEN": "256",
        "NTS_MAX_NUM_SEQS": "8",
        "NTS_DTYPE": "float32",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "noisy_temp_server.cli", "serve"]
    with running_server(
        "server /health",
        command,
        port=port,
        log=work / "server.log",
        timeout_s=SERVER_START_TIMEOUT_S,
        env=env,
    ) as url:
        yield url


def send_traffic(url: str) -> None:
    """Completions under several rules, so every step bucket label and rule path is used."""
    bodies: list[dict[str, Any]] = [
        {"nts_rule": "fixed", "nts_t": 1.3},
        {"nts_rule": "sqrt"},
        {"nts_rule": "linear"},
        {},
        {"temperature": 0.0},
        {"nts_tune": False},
    ]
    with httpx.Client(base_url=url, timeout=120) as client:
        for i, extra in enumerate(bodies):
            body = {
                "model": "tiny",
                "prompt": f"def add(a, b): return a + b  # {i}",
                "max_tokens": 24,
                "temperature": 1.0,
                "seed": i,
                **extra,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text


def metric_value(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    ]
    return max(values, default=0.0)


@pytest.fixture(scope="module")
def traffic(server_url: str) -> str:
    """Two waves of traffic around the estimator's first published policy."""
    send_traffic(server_url)
    deadline = time.monotonic() + SHADOW_TIMEOUT_S
    while metric_value(server_url, "nts_estimator_last_update_timestamp_seconds") <= 0:
        if time.monotonic() > deadline:
            pytest.fail(
                "the online estimator published no policy within "
                f"{SHADOW_TIMEOUT_S} s of shadow-scored traffic"
            )
        time.sleep(2.0)
    send_traffic(server_url)
    return server_url


@pytest.fixture(scope="module")
def prometheus_url(
    traffic: str, prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Debian's Prometheus with deploy/prometheus/prometheus.yml, pointed at the live server."""
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL}
    config["rule_files"] = [str(DEPLOY / "prometheus" / name) for name in config["rule_files"]]
    targets = {
        "noisy-temp-server": traffic.removeprefix("http://"),
        "prometheus": f"127.0.0.1:{port}",
    }
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = work / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                prometheus_binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            "prometheus ready",
            60,
            lambda: httpx.get(f"{url}/-/ready", timeout=5).status_code == 200,
            process,
            log,
        )
        # Enough scrapes for rate() over the 1m windows the dashboard gets in place of
        # $__rate_interval.
        wait_until(
            "ten scrapes of the server",
            90,
            lambda: query(url, 'count_over_time(up{job="noisy-temp-server"}[1m]) >= 10'),
            process,
            log,
        )
        yield url
    finally:
        stop(process)


def query(prometheus: str, expr: str) -> list[Any]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30)
    assert response.status_code == 200, f"{expr}\n{response.text}"
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


def test_the_server_is_scraped(prometheus_url: str) -> None:
    (up,) = query(prometheus_url, 'up{job="noisy-temp-server"}')
    assert up["value"][1] == "1"


def test_every_dashboard_expression_returns_data(
    prometheus_url: str, all_expressions: list[Any]
) -> None:
    empty = [
        f"{e.where}: {e.expr}"
        for e in all_expressions
        if e.where.startswith("dashboard") and not query(prometheus_url, e.expr)
    ]
    assert not empty, "no data for:\n" + "\n".join(empty)


def test_every_alert_expression_evaluates(prometheus_url: str, all_expressions: list[Any]) -> None:
    for expression in all_expressions:
        if expression.where.startswith("alert"):
            query(prometheus_url, expression.expr)
    rules = httpx.get(f"{prometheus_url}/api/v1/rules", timeout=30).json()["data"]["groups"]
    evaluated = {r["name"]: r for g in rules for r in g["rules"]}
    assert len(evaluated) == 7
    for name, rule in evaluated.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
