"""The trace channel (PUSH -> PULL), its asyncio waits, and the step temperature histogram."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from noisy_temp_server.engine_contract.keys import TRACE_ENDPOINT_ENV
from noisy_temp_server.engine_contract.trace_channel import TraceReport
from noisy_temp_server.engine_contract.trace_sender import TraceSender
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.step.engine_metrics import (
    STEP_TEMPERATURE_BUCKETS,
    StepTemperatureMetrics,
    step_temperature_metrics,
)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/trace.sock"


def _wait(collector: TraceCollector, trace_id: str, n_steps: int, **kwargs: Any) -> TraceReport:
    return asyncio.run(collector.wait_for(trace_id, n_steps, **kwargs))


def test_collector_merges_summary_parts_and_orders_the_trace(endpoint: str) -> None:
    with TraceCollector(endpoint) as collector:
        sender = TraceSender(endpoint)
        sender.send_step([("a", 1, 1.5), ("b", 0, 2.0)])
        sender.send_step([("a", 0, 1.25)])
        sender.send_summaries([("a", 1, 1.25, 1, 1.25, 1.25)])  # replaced by the next one
        sender.send_summaries([("a", 1, 2.75, 2, 1.25, 1.5), ("b", 7, 2.0, 1, 2.0, 2.0)])
        sender.send_summaries([("a", 2, 1.0, 1, 1.0, 1.0)])  # after a preemption
        sender.send_step([("a", 2, 1.0)])
        report = _wait(collector, "a", 3, timeout=5.0, want_trace=True)
        assert report == TraceReport(
            steps=3, t_mean=pytest.approx(3.75 / 3), t_min=1.0, t_max=1.5, trace=(1.25, 1.5, 1.0)
        )
        assert _wait(collector, "b", 1, timeout=5.0).t_mean == 2.0
        assert collector.pending_ids() == 0
        sender.close()


def test_wait_for_returns_what_arrived_on_timeout(endpoint: str) -> None:
    with TraceCollector(endpoint) as collector:
        sender = TraceSender(endpoint)
        sender.send_summaries([("a", 1, 1.5, 1, 1.5, 1.5)])
        start = time.monotonic()
        assert _wait(collector, "a", 2, timeout=0.5).steps == 1
        assert time.monotonic() - start >= 0.45
        assert _wait(collector, "never", 1, timeout=0.05) == TraceReport()
        sender.close()


def test_waiting_ties_up_no_thread(endpoint: str) -> None:
    async def wait_many(collector: TraceCollector) -> list[TraceReport]:
        waits = [collector.wait_for(f"lost-{i}", 1, timeout=0.3) for i in range(64)]
        return await asyncio.gather(*waits)

    with TraceCollector(endpoint) as collector:
        threads = threading.active_count()
        start = time.monotonic()
        reports = asyncio.run(wait_many(collector))
        assert time.monotonic() - start < 2.0  # concurrent, not one after the other
        assert reports == [TraceReport()] * 64
        assert threading.active_count() == threads


def test_ids_nobody_waits_for_expire(endpoint: str) -> None:
    with TraceCollector(endpoint, ttl_s=0.2) as collector:
        sender = TraceSender(endpoint)
        sender.send_step([("stale", 0, 1.0)])
        deadline = time.monotonic() + 5.0
        while collector.pending_ids() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.pending_ids() == 1
        while collector.pending_ids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert collector.pending_ids() == 0
        sender.close()


def _until(condition: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


def test_forgotten_ids_are_dropped_and_their_late_records_ignored(endpoint: str) -> None:
    with TraceCollector(endpoint, forgotten_grace_s=0.2) as collector:
        sender = TraceSender(endpoint)
        sender.send_summaries([("gone", 0, 1.5, 1, 1.5, 1.5)])
        assert _until(lambda: collector.pending_ids() == 1)
        collector.forget("gone")
        assert collector.pending_ids() == 0
        sender.send_step([("gone", 1, 1.5)])  # a late report of the cancelled request
        sender.send_summaries([("gone", 0, 3.0, 2, 1.5, 1.5), ("marker", 0, 1.0, 1, 1.0, 1.0)])
        assert _until(lambda: collector.pending_ids() == 1)  # the marker arrived ...
        assert _wait(collector, "marker", 1, timeout=1.0).steps == 1
        assert collector.pending_ids() == 0  # ... and nothing opened an entry for "gone"
        time.sleep(1.5)  # past the grace period (swept once a second): the id is new again
        sender.send_step([("gone", 0, 1.0)])
        assert _until(lambda: collector.pending_ids() == 1)
        sender.close()


def test_a_cancelled_wait_forgets_its_id(endpoint: str) -> None:
    async def cancel_a_wait(collector: TraceCollector) -> None:
        wait = asyncio.create_task(collector.wait_for("c", 5, timeout=30.0))
        await asyncio.sleep(0.2)
        wait.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await wait

    with TraceCollector(endpoint) as collector:
        sender = TraceSender(endpoint)
        sender.send_summaries([("c", 0, 1.5, 1, 1.5, 1.5)])
        assert _until(lambda: collector.pending_ids() == 1)
        asyncio.run(cancel_a_wait(collector))
        assert collector.pending_ids() == 0
        sender.close()


def test_forget_wakes_a_wait_in_progress_with_an_empty_report(endpoint: str) -> None:
    async def forget_while_waiting(collector: TraceCollector) -> tuple[TraceReport, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = asyncio.create_task(collector.wait_for("w", 5, timeout=30.0))
        await asyncio.sleep(0.1)
        collector.forget("w")
        return await wait, loop.time() - started

    with TraceCollector(endpoint) as collector:
        report, elapsed = asyncio.run(forget_while_waiting(collector))
    assert report == TraceReport()
    assert elapsed < 5.0


def test_sender_without_reader_drops_and_counts_instead_of_blocking(endpoint: str) -> None:
    sender = TraceSender(endpoint)
    start = time.monotonic()
    results = [sender.send_step([("a", i, 1.0)]) for i in range(5000)]
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


def test_step_temperature_histogram_adds_pre_binned_counts() -> None:
    registry = CollectorRegistry()
    metrics = StepTemperatureMetrics(registry)
    counts = [0.0] * (len(STEP_TEMPERATURE_BUCKETS) + 1)
    counts[STEP_TEMPERATURE_BUCKETS.index(0.75)] = 1  # 0.6
    counts[STEP_TEMPERATURE_BUCKETS.index(1.2)] = 1  # 1.2
    metrics.add("sqrt", "0-7", counts, 1.8)
    metrics.add("sqrt", "8-31", [0.0] * 5 + [1.0] + [0.0] * 12, 1.0)

    def sample(suffix: str, bucket: str, **extra: str) -> float | None:
        labels = {"step_bucket": bucket, "rule": "sqrt", **extra}
        return registry.get_sample_value(f"nts_step_temperature{suffix}", labels)

    assert sample("_count", "0-7") == 2
    assert sample("_sum", "0-7") == pytest.approx(1.8)
    assert sample("_bucket", "0-7", le="0.75") == 1
    assert sample("_bucket", "0-7", le="1.2") == 2
    assert sample("_count", "8-31") == 1
    with pytest.raises(ValueError, match="bucket counts"):
        metrics.add("sqrt", "0-7", [1.0, 2.0], 3.0)


def test_step_temperature_metrics_is_registered_once_per_registry() -> None:
    registry = CollectorRegistry()
    assert step_temperature_metrics(registry) is step_temperature_metrics(registry)
