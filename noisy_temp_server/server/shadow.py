"""The shadow scorer: online estimation from a sample of live traffic, off the serving path.

The HTTP layer calls `ShadowScorer.admit` for every choice it admits whose served rows the
engine can capture (`vllm_plugin.capture.capturable`): a fraction of them are sampled, and a
sampled choice runs with its per-step T* trace and with the capture of its served logits
(``nts_capture``: the engine sends the rows it sampled from, before any temperature, for the
first `positions` steps) and goes to `ShadowScorer.submit` when it finishes, which puts it on a
bounded queue without ever blocking (a full queue drops the item and counts it). One daemon
thread takes items off the queue, takes the item's captured rows (`rows`, the trace channel's
`TraceCollector.take_rows`; an item whose rows never came is dropped, reason
``not_captured``), runs only the clean model teacher-forced over the same tokens and scores the
pair (`pairs.scorer.PairScorer.score_live`: only what the live metrics and the online estimator
need, no per-position oracle), feeds the per-position records to the online
estimator and the per-position scores (T = 1 and the T* the engine applied) to the live
scoreboard (`estimation.scoreboard.LiveScoreboard`, published on the status endpoint and as
`nts_scoreboard_*` gauges) and, when the estimator publishes a new policy version, updates
the policy gauges. New requests pick the new version up from the estimator; requests in
flight keep the version they were admitted with.

Cost: the scorer runs teacher-forced passes per scored request on `shadow_device`. On the CPU
it shares the cores with the engine, so it has its own budget: `threads` torch threads (torch's
intra-op pool is process-wide, and in the API process only the scorer uses it) and a scoring
thread `nice` steps below the process, so the engine wins the cores whenever both want them and
the scorer catches up in the gaps. `nts_shadow_score_seconds` and
`nts_shadow_tokens_scored_total` give its cost per scored token, and `status()` reports it.

Faults stay off the serving path: `submit` never blocks and never raises for a scoring fault; a
failure while scoring an item drops that item (`nts_shadow_requests_dropped_total{reason=
"error"}`) and the thread goes on; a hung scorer fills the queue, so later items are dropped
(`reason="queue_full"`) and `status()["busy_for_s"]` grows. Either way requests are served as
if there were no scorer.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from noisy_temp_server.estimation.scoreboard import LiveScoreboard
from noisy_temp_server.pairs.scorer import (
    LiveScores,
    PositionRecords,
    ScoringSequence,
    ServedRows,
)
from noisy_temp_server.server.metrics import ApiMetrics
from noisy_temp_server.temperature.bias import PairedRows

__all__ = ["CapturedRowsSource", "PolicyEstimator", "SequenceScorer", "ShadowScorer"]

_LOGGER = logging.getLogger(__name__)


class SequenceScorer(Protocol):
    """What the shadow loop needs of `PairScorer`."""

    def score_live(
        self,
        sequence: ScoringSequence,
        served_temperatures: Sequence[float],
        served: ServedRows,
        max_rows: int = 0,
    ) -> LiveScores: ...

    def clean_status(self) -> dict[str, Any]: ...


class CapturedRowsSource(Protocol):
    """Where the engine's captured rows of a request are (`TraceCollector`)."""

    def take_rows(self, trace_id: str, n_steps: int, timeout: float) -> Any: ...

    def drop_rows(self, trace_id: str) -> None: ...

    def capture_drops(self) -> dict[str, int]: ...


class PolicyEstimator(Protocol):
    """What the shadow loop needs of `estimation.online.OnlineEstimator`."""

    def add(self, records: PositionRecords, rows: PairedRows | None = None) -> Any: ...

    def current_policy(self) -> Any: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class _Item:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    served_temperatures: tuple[float, ...]
    sequence_id: int
    trace_id: str


class ShadowScorer:
    """Bounded-queue background scoring of a sample of finished requests.

    `on_policy(policy)` is called from the scorer thread whenever the estimator's policy
    version changes (e.g. to update gauges). `threads`: torch's intra-op threads for the
    process (None: leave them); `nice`: how many nice steps the scoring thread runs below the
    process (0: same priority). `rows`: the captured served rows (`CapturedRowsSource`);
    `positions`: the steps the engine captures per request (``capture_positions``);
    `rows_timeout_s`: how long the scoring thread waits for rows still under way;
    `bias_rows`: paired rows per scored request passed to the estimator for the online bias
    (0: none).
    Thread-safe `admit` and `submit`; `start` once, `close` once.
    """

    def __init__(
        self,
        scorer: SequenceScorer,
        estimator: PolicyEstimator,
        metrics: ApiMetrics,
        *,
        fraction: float,
        queue_size: int,
        version_of: Callable[[Any], int],
        on_policy: Callable[[Any], None],
        rows: CapturedRowsSource,
        positions: int,
        rows_timeout_s: float = 2.0,
        rng: random.Random | None = None,
        scoreboard: LiveScoreboard | None = None,
        threads: int | None = None,
        nice: int = 0,
        bias_rows: int = 0,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"shadow fraction must be in [0, 1], got {fraction}")
        if queue_size < 1:
            raise ValueError(f"shadow queue size must be >= 1, got {queue_size}")
        self._scorer = scorer
        self._rows = rows
        self._positions = positions
        self._rows_timeout_s = rows_timeout_s
        self._estimator = estimator
        self._metrics = metrics
        self._fraction = fraction
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=queue_size)
        self._version_of = version_of
        self._on_policy = on_policy
        self._rng = rng or random.Random()
        self._scoreboard = scoreboard or LiveScoreboard()
        self._scoreboard_result: dict[str, Any] | None = None
        self._threads = threads
        self._nice = nice
        self._bias_rows = bias_rows
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next_sequence_id = 0
        self._counts = {"offered": 0, "sampled": 0, "scored": 0, "dropped_queue_full": 0}
        self._counts |= {"dropped_error": 0, "dropped_not_captured": 0, "tokens": 0}
        self._seconds = {"rows_wait": 0.0, "scoring": 0.0, "estimation": 0.0, "cpu": 0.0}
        self._scoring_since: float | None = None
        self._last_version = version_of(estimator.current_policy())

    def admit(self) -> bool:
        """Draw whether a choice being admitted is sampled for scoring (counted as offered, and
        as sampled when it is). A sampled choice must be generated with its per-step trace and
        handed to `submit` when it finishes; an unsampled one costs nothing more."""
        with self._lock:
            self._counts["offered"] += 1
            if self._rng.random() >= self._fraction:
                return False
            self._counts["sampled"] += 1
            return True

    def submit(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        served_temperatures: Sequence[float],
        trace_id: str,
    ) -> bool:
        """Queue a finished choice that `admit` sampled; never blocks. Returns whether it was
        queued (False for an empty completion, or when the queue is full: dropped, counted;
        either way its captured rows are let go).

        `served_temperatures`: the T* of each generated step (may be shorter than the
        completion, or empty, when the trace is incomplete); `trace_id`: the choice's key on
        the trace channel, under which the engine captured its served rows.
        """
        if not completion_ids:
            self._rows.drop_rows(trace_id)
            return False
        with self._lock:
            sequence_id = self._next_sequence_id
            self._next_sequence_id += 1
        item = _Item(
            tuple(prompt_ids),
            tuple(completion_ids),
            tuple(served_temperatures),
            sequence_id,
            trace_id,
        )
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._rows.drop_rows(trace_id)
            with self._lock:
                self._counts["dropped_queue_full"] += 1
            self._metrics.shadow_requests_dropped.labels(reason="queue_full").inc()
            return False
        return True

    def start(self) -> ShadowScorer:
        """Start the scoring thread (daemon). Returns self."""
        if self._thread is not None:
            raise RuntimeError("ShadowScorer already started.")
        self._thread = threading.Thread(target=self._loop, name="nts-shadow-scorer", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the item being scored; items still queued are discarded."""
        if self._thread is None:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued item has been handled (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def status(self) -> dict[str, Any]:
        """Counters, queue depth, measured cost (wall seconds of the clean pass and scoring, per
        scored token; the wall seconds spent waiting for captured rows and in the estimator and
        scoreboard; the scoring thread's CPU seconds), whether the scoring thread runs, and for
        how long the item being scored has taken so far (`busy_for_s`, None when idle: a large
        value means a hung scorer, whose queue then fills and drops);
        the live scoreboard (None before the first scored request), the clean backend's
        own status (e.g. a remote clean server's failures and last error) and the captured
        served rows dropped, by reason (`CapturedRowsSource.capture_drops`)."""
        with self._lock:
            counts = dict(self._counts)
            seconds = dict(self._seconds)
            since = self._scoring_since
            scoreboard = self._scoreboard_result
        tokens = counts["tokens"]
        return {
            "enabled": True,
            "running": self._thread is not None and self._thread.is_alive(),
            "fraction": self._fraction,
            "queue_depth": self._queue.qsize(),
            "queue_size": self._queue.maxsize,
            "busy_for_s": None if since is None else time.monotonic() - since,
            **counts,
            "score_seconds_total": seconds["scoring"],
            "seconds_per_scored_token": seconds["scoring"] / tokens if tokens else None,
            "rows_wait_seconds_total": seconds["rows_wait"],
            "estimation_seconds_total": seconds["estimation"],
            "cpu_seconds_total": seconds["cpu"],
            "threads": self._threads,
            "nice": self._nice,
            "scoreboard": scoreboard,
            "clean_backend": self._scorer.clean_status(),
            "capture_dropped_rows": self._rows.capture_drops(),
        }

    def _loop(self) -> None:
        """Score items until the `None` sentinel. A failure anywhere in scoring, estimation or
        publication drops that item (counted, reason `error`) and never ends the loop."""
        self._take_budget()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                with self._lock:
                    self._scoring_since = time.monotonic()
                self._score(item)
            except Exception:
                _LOGGER.exception("Shadow scoring failed; the request is dropped from estimation")
                with self._lock:
                    self._counts["dropped_error"] += 1
                self._metrics.shadow_requests_dropped.labels(reason="error").inc()
            finally:
                with self._lock:
                    self._scoring_since = None
                self._queue.task_done()

    def _take_budget(self) -> None:
        """Apply the scorer's CPU budget from its own thread (see the class docstring)."""
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        if self._nice:
            thread = threading.get_native_id()
            try:
                current = os.getpriority(os.PRIO_PROCESS, thread)
                os.setpriority(os.PRIO_PROCESS, thread, min(19, current + self._nice))
            except OSError as error:
                _LOGGER.warning("Cannot lower the shadow scorer's priority: %s", error)

    def _score(self, item: _Item) -> None:
        cpu = time.thread_time()
        waiting = time.perf_counter()
        expected = min(len(item.completion_ids), self._positions)
        captured = self._rows.take_rows(item.trace_id, expected, self._rows_timeout_s)
        started = time.perf_counter()
        self._add_seconds("rows_wait", started - waiting)
        if captured is None or not len(captured.steps):
            with self._lock:
                self._counts["dropped_not_captured"] += 1
            self._metrics.shadow_requests_dropped.labels(reason="not_captured").inc()
            return
        sequence = ScoringSequence(
            token_ids=[*item.prompt_ids, *item.completion_ids],
            prompt_length=len(item.prompt_ids),
            sequence_id=item.sequence_id,
        )
        served = ServedRows(torch.from_numpy(captured.steps), torch.from_numpy(captured.rows))
        live = self._scorer.score_live(sequence, item.served_temperatures, served, self._bias_rows)
        scored = time.perf_counter()
        elapsed = scored - started
        self._estimator.add(live.records, live.rows)
        self._scoreboard.update(live.at_one, live.at_served)
        scoreboard = self._scoreboard.result()
        with self._lock:
            self._scoreboard_result = scoreboard
        self._metrics.publish_scoreboard(scoreboard)
        self._observe(live, elapsed)
        policy = self._estimator.current_policy()
        version = self._version_of(policy)
        if version != self._last_version:
            self._last_version = version
            _LOGGER.info("Online estimator published policy version %d", version)
            self._on_policy(policy)
        self._add_seconds("estimation", time.perf_counter() - scored)
        self._add_seconds("cpu", time.thread_time() - cpu)

    def _add_seconds(self, part: str, seconds: float) -> None:
        with self._lock:
            self._seconds[part] += seconds

    def _observe(self, live: LiveScores, elapsed: float) -> None:
        count = len(live.records)
        with self._lock:
            self._counts["scored"] += 1
            self._counts["tokens"] += count
            self._seconds["scoring"] += elapsed
        metrics = self._metrics
        metrics.shadow_requests_scored.inc()
        metrics.shadow_tokens_scored.inc(count)
        metrics.shadow_score_seconds.observe(elapsed)
        for temperature, scores in (("one", live.at_one), ("served", live.at_served)):
            histogram = metrics.shadow_kl.labels(temperature=temperature)
            for value in scores.kld.tolist():
                histogram.observe(value)
