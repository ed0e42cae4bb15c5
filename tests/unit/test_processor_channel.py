"""The trace channel (PUSH -> PULL) and the engine-side step temperature histogram."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from noisy_temp_server.vllm_plugin.metrics import StepTemperatureMetrics, step_temperature_metrics
from noisy_temp_server.vllm_plugin.trace_channel import (
    TRACE_ENDPOINT_ENV,
    TraceCollector,
    TraceSender,
)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/trace.sock"


def test_collector_returns_steps_in_order_and_forgets_the_id(endpoint: str) -> None:
    with TraceCollector(endpoint) as collector:
        sender = TraceSender(endpoint)
        sender.send_step(["a", "b"], [1, 0], [1.5, 2.0])
        sender.send_step(["a"], [0], [1.25])
        sender.send_step(["a"], [2], [1.125])
        assert collector.wait_for("a", 3, timeout=5.0) == [1.25, 1.5, 1.125]
        assert collector.wait_for("b", 1, timeout=5.0) == [2.0]
        assert collector.pending_ids() == 0
        sender.close()


def test_wait_for_returns_what_arrived_on_timeout(endpoint: str) -> None:
    with TraceCollector(endpoint) as collector:
        sender = TraceSender(endpoint)
        sender.send_step(["a"], [0], [1.5])
        start = time.monotonic()
        assert collector.wait_for("a", 2, timeout=0.5) == [1.5]
        assert time.monotonic() - start >= 0.45
        assert collector.wait_for("never", 1, timeout=0.05) == []
        sender.close()


def test_ids_nobody_waits_for_expire(endpoint: str) -> None:
    with TraceCollector(endpoint, ttl_s=0.2) as collector:
        sender = TraceSender(endpoint)
        sender.send_step(["stale"], [0], [1.0])
        deadline = time.monotonic() + 5.0
        while collector.pending_ids() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.pending_ids() == 1
        while collector.pending_ids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert collector.pending_ids() == 0
        sender.close()


def test_sender_without_reader_drops_and_counts_instead_of_blocking(endpoint: str) -> None:
    sender = TraceSender(endpoint)
    start = time.monotonic()
    results = [sender.send_step(["a"], [i], [1.0]) for i in range(5000)]
    assert time.monotonic() - start < 5.0
    assert not all(results)
    assert sender.dropped_messages == results.count(False) > 0
    sender.close()


def test_sender_from_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.delenv(TRACE_ENDPOINT_ENV, raising=False)
    assert TraceSender.from_env() is None
    monkeypatch.setenv(TRACE_ENDPOINT_ENV, endpoint)
    sender = TraceSender.from_env()
    assert sender is not None
    assert sender.endpoint == endpoint
    sender.close()


def test_step_temperature_histogram_counts_per_bucket_and_rule() -> None:
    registry = CollectorRegistry()
    metrics = StepTemperatureMetrics(registry)
    metrics.observe("sqrt", ["0-7", "0-7", "8-31"], [1.2, 0.6, 1.0])

    def sample(suffix: str, bucket: str, **extra: str) -> float | None:
        labels = {"step_bucket": bucket, "rule": "sqrt", **extra}
        return registry.get_sample_value(f"nts_step_temperature{suffix}", labels)

    assert sample("_count", "0-7") == 2
    assert sample("_sum", "0-7") == pytest.approx(1.8)
    assert sample("_bucket", "0-7", le="0.75") == 1
    assert sample("_bucket", "0-7", le="1.2") == 2
    assert sample("_count", "8-31") == 1
    with pytest.raises(ValueError, match="labels"):
        metrics.observe("sqrt", ["0-7"], [1.0, 2.0])


def test_step_temperature_metrics_is_registered_once_per_registry() -> None:
    registry = CollectorRegistry()
    assert step_temperature_metrics(registry) is step_temperature_metrics(registry)
