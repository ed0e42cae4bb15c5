"""Engine-side Prometheus metrics of the logits processor.

`nts_step_temperature{step_bucket, rule}`: the T* applied per tuned row per decode step
(see docs/architecture.md, "Metrics"). The registry is injected; inside vLLM's engine process the
processor uses prometheus_client's default ``REGISTRY``, whose values live in
``$PROMETHEUS_MULTIPROC_DIR`` when that is set, so the API process's ``MultiProcessCollector``
serves them (a custom collector would not cross the process boundary, hence a plain
``Histogram``).

Cost: nothing per row and step. The processor accumulates the count and sum of T* per request
and step bucket on the device; its reporter thread adds what each of those gained since the last
report (every 20 ms) with `StepTemperatureMetrics.add`, binned at the gain's mean (exact for
rules constant on a step bucket; see `reports`). prometheus_client has no public bulk
observation, so `add` increments the child's bucket and sum values directly (``_buckets``,
``_sum``: the same value objects ``observe`` increments, multiprocess mode included).
Label children are cached per (step bucket, rule).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

__all__ = [
    "MAX_LABELS",
    "OVERFLOW_STEP_BUCKET",
    "STEP_TEMPERATURE_BUCKETS",
    "StepTemperatureMetrics",
    "step_temperature_metrics",
]

STEP_TEMPERATURE_BUCKETS: tuple[float, ...] = (
    0.25, 0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0,
)  # fmt: skip

MAX_LABELS = 256
"""Distinct (step bucket, rule) label pairs of ``nts_step_temperature`` a processor names;
later pairs share the step bucket `OVERFLOW_STEP_BUCKET` of their rule (requests choose their
own step edges, so the label set is otherwise unbounded)."""
OVERFLOW_STEP_BUCKET = "other"


class StepTemperatureMetrics:
    """The ``nts_step_temperature`` histogram, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "nts_step_temperature",
            "T* applied per tuned row per decode step (without the request's own temperature).",
            labelnames=("step_bucket", "rule"),
            buckets=STEP_TEMPERATURE_BUCKETS,
            registry=registry,
        )
        self._children: dict[tuple[str, str], Histogram] = {}

    def add(self, rule: str, step_bucket_label: str, counts: Sequence[float], total: float) -> None:
        """Add pre-binned observations: ``counts[i]`` values fell in bucket ``i`` (the
        ``le`` buckets of `STEP_TEMPERATURE_BUCKETS`, then +Inf), summing to ``total``."""
        if len(counts) != len(STEP_TEMPERATURE_BUCKETS) + 1:
            raise ValueError(
                f"expected {len(STEP_TEMPERATURE_BUCKETS) + 1} bucket counts, got {len(counts)}"
            )
        child = self._child(step_bucket_label, rule)
        for bucket, count in zip(child._buckets, counts, strict=True):
            if count:
                bucket.inc(float(count))
        child._sum.inc(total)

    def _child(self, label: str, rule: str) -> Histogram:
        child = self._children.get((label, rule))
        if child is None:
            child = self._children[label, rule] = self.histogram.labels(
                step_bucket=label, rule=rule
            )
        return child


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, StepTemperatureMetrics] = (
    weakref.WeakKeyDictionary()
)


def step_temperature_metrics(registry: CollectorRegistry | None = None) -> StepTemperatureMetrics:
    """The one `StepTemperatureMetrics` of ``registry`` (default: prometheus_client's ``REGISTRY``).

    Created on first use and shared afterwards, so several processors in one process (e.g. two
    engines in a test session) do not register the metric twice.
    """
    target = REGISTRY if registry is None else registry
    metrics = _BY_REGISTRY.get(target)
    if metrics is None:
        metrics = _BY_REGISTRY[target] = StepTemperatureMetrics(target)
    return metrics
