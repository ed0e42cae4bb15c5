"""The shadow scorer: online estimation from a sample of live traffic, off the serving path.

The HTTP layer calls `ShadowScorer.admit` for every choice it admits whose served rows the
engine can capture (`engine_contract.request_args.capturable`): a fraction of them are sampled,
and a sampled choice runs with its per-step T* trace and with the capture of its served logits
(``nts_capture``: the engine sends the rows it sampled from, before any temperature, for the
first `positions` steps) and goes to `ShadowScorer.submit` when it finishes, which puts it on a
bounded queue without ever blocking (a full queue drops the item and counts it). One daemon
thread takes items off the queue, takes the item's captured rows (`rows`, the trace channel's
`TraceCollector.take_rows`; an item whose rows never came is dropped, reason
``not_captured``), runs only the clean model teacher-forced over the same tokens and scores the
pair (`scoring.scorer.PairScorer.score_live`: only what the live metrics and the online estimator
need: no per-position oracle, and no KL curves when the estimator refits no rule that reads
them, `OnlineEstimator.reads_kl_curves`), feeds the per-position records (measured at request
temperature 1, what the estimator's fits read) to the online estimator and the per-position
scores against the clean model at the choice's own temperature T_r, softmax(z / T_r), untuned
(T* = 1: softmax(z~ / T_r)) and as served (softmax((z~ + b) / (T_r T*)) with the choice's
bias b if it had one, at the T* the engine applied), to the live scoreboard
(`scoring.scoreboard.LiveScoreboard`, published on the status endpoint and as
`nts_scoreboard_*` gauges) and, when the estimator publishes a new policy version, updates the
policy gauges. New requests pick the new version up from the estimator; requests in flight keep
the version they were admitted with.

Cost: the scorer runs teacher-forced passes per scored request on `shadow_device`. On the CPU
it shares the cores with the engine, so it keeps to a budget (`CpuBudget`): at most
`cpu_share` of the machine's CPU time (all cores), measured as the scoring thread's CPU time.
Sampling adapts to it: a request drawn at `fraction` is sampled only while the budget has
credit, and its expected cost (its positions, at most `positions`, times the measured CPU
seconds per scored position) is reserved at admission and settled with what scoring it really
cost; a request drawn while the budget is spent is skipped (counted, ``skipped_budget``).
Until the estimator publishes its first policy the budget is `warmup_cpu_share` and the thread
runs at the process's priority, so that a new server gets its first online policy quickly;
from then on it is `cpu_share` and the thread runs `nice` steps below the process, so the engine
wins the cores whenever both want them. `threads` torch threads (torch's intra-op pool is
process-wide, and in the API process only the scorer uses it). `nts_shadow_score_seconds` and
`nts_shadow_tokens_scored_total` give its cost per scored token, and `status()` reports it with
the budget's state.

Faults stay off the serving path: `submit` never blocks and never raises for a scoring fault; a
failure while scoring an item drops that item (`nts_shadow_requests_dropped_total{reason=
"error"}`) and the thread goes on; a hung scorer fills the queue, so later items are dropped
(`reason="queue_full"`) and `status()["busy_for_s"]` grows. Either way requests are served as
if there were no scorer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from noisy_temp_server.engine_contract.bias_files import load_bias
from noisy_temp_server.engine_contract.request_args import LogitCorrection
from noisy_temp_server.engine_contract.trace_channel import TraceSource
from noisy_temp_server.online.cpu_budget import CpuBudget
from noisy_temp_server.online.metrics import OnlineMetrics
from noisy_temp_server.scoring.scoreboard import LiveScoreboard
from noisy_temp_server.scoring.scorer import LiveScores, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence

if TYPE_CHECKING:
    from noisy_temp_server.online.estimator import OnlineEstimator

__all__ = [
    "SequenceScorer",
    "ShadowScorer",
    "request_sequence_id",
]

_LOGGER = logging.getLogger(__name__)


class SequenceScorer(Protocol):
    """What the shadow loop needs of `PairScorer`."""

    def score_live(
        self,
        sequence: ScoringSequence,
        served_temperatures: Sequence[float],
        served: ServedRows,
        max_rows: int = 0,
        *,
        request_temperature: float,
        kl_curve: bool = True,
        bias: torch.Tensor | None = None,
    ) -> LiveScores: ...

    def clean_status(self) -> dict[str, Any]: ...


def request_sequence_id(request_id: str) -> int:
    """The sequence id of every choice of request `request_id`: 56 bits of its blake2b hash
    (non-negative, fits int64; evenly spread, so `id % k` picks about one request in k)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


WARMUP_HORIZON_S = 10.0
"""The warm-up budget holds 10 s worth of credit: a wave of concurrent admissions may take
several requests at once, so the first policy is not held back by the bucket's burst."""
STEADY_HORIZON_S = 1.0
"""Then 1 s worth: after a quiet spell the scorer spends at most that in a burst."""


@dataclass(frozen=True)
class _Item:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    served_temperatures: tuple[float, ...]
    request_temperature: float
    sequence_id: int
    trace_id: str
    reserved_s: float
    correction: LogitCorrection | None  # the bias the request was served with


class ShadowScorer:
    """Bounded-queue background scoring of a sample of finished requests.

    `on_policy(policy)` is called from the scorer thread whenever the estimator's policy
    version changes (e.g. to update gauges). `threads`: torch's intra-op threads for the
    process (None: leave them); `nice`: how many nice steps the scoring thread runs below the
    process once the first policy is out (0: same priority). `cpu_share`,
    `warmup_cpu_share`: the CPU budget after and before the first policy, as shares of the
    machine (`cores` CPUs; default: those this process may run on); `cost_per_position_s`: the
    CPU seconds per scored position assumed until the first request is scored.
    `rows`: the captured served rows (`engine_contract.trace_channel.TraceSource`);
    `positions`: the steps the engine captures per request (``capture_positions``);
    `rows_timeout_s`: how long the scoring thread waits for rows still under way;
    `bias_rows`: paired rows per scored request passed to the estimator for the online bias
    (0: none).
    Thread-safe `admit`, `submit` and `cancel`; `start` once, `close` once.
    """

    def __init__(
        self,
        scorer: SequenceScorer,
        estimator: OnlineEstimator,
        metrics: OnlineMetrics,
        *,
        fraction: float,
        queue_size: int,
        version_of: Callable[[Any], int],
        on_policy: Callable[[Any], None],
        rows: TraceSource,
        positions: int,
        rows_timeout_s: float = 2.0,
        rng: random.Random | None = None,
        scoreboard: LiveScoreboard | None = None,
        threads: int | None = None,
        nice: int = 0,
        bias_rows: int = 0,
        cpu_share: float = 1.0,
        warmup_cpu_share: float = 1.0,
        cores: int | None = None,
        cost_per_position_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
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
        self._counts = {"offered": 0, "sampled": 0, "scored": 0, "dropped_queue_full": 0}
        self._counts |= {"dropped_error": 0, "dropped_not_captured": 0, "tokens": 0}
        self._counts |= {"skipped_budget": 0}
        self._cpu_share = cpu_share
        self._warmed_up = False
        machine = len(os.sched_getaffinity(0)) if cores is None else cores
        self._budget = CpuBudget(warmup_cpu_share, machine, horizon_s=WARMUP_HORIZON_S, clock=clock)
        self._cost_per_position_s = cost_per_position_s
        self._reserved: dict[str, float] = {}
        self._seconds = {"rows_wait": 0.0, "scoring": 0.0, "estimation": 0.0, "cpu": 0.0}
        self._scoring_since: float | None = None
        self._last_version = version_of(estimator.current_policy())

    def admit(self, trace_id: str, max_positions: int) -> bool:
        """Draw whether a choice being admitted (at most `max_positions` generated tokens) is
        sampled for scoring: drawn at `fraction`, and only while the CPU budget has credit, of
        which its expected cost is reserved (counted as offered, as sampled when it is, as
        skipped_budget when drawn without credit). A sampled choice must be generated with its
        per-step trace and capture under `trace_id` and handed to `submit` when it finishes,
        or to `cancel`; an unsampled one costs nothing more."""
        with self._lock:
            self._counts["offered"] += 1
            if self._rng.random() >= self._fraction:
                return False
            expected = min(max_positions, self._positions) * self._cost_per_position_s
            if not self._budget.take(expected):
                self._counts["skipped_budget"] += 1
                return False
            self._reserved[trace_id] = expected
            self._counts["sampled"] += 1
            return True

    def cancel(self, trace_id: str) -> None:
        """A sampled choice that ends without `submit` (cancelled, failed): its reservation
        goes back to the budget and its captured rows are let go."""
        with self._lock:
            self._budget.give(self._reserved.pop(trace_id, 0.0))
        self._rows.drop_rows(trace_id)

    def submit(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        served_temperatures: Sequence[float],
        trace_id: str,
        *,
        request_id: str,
        request_temperature: float,
        correction: LogitCorrection | None = None,
    ) -> bool:
        """Queue a finished choice that `admit` sampled; never blocks. Returns whether it was
        queued (False for an empty completion, or when the queue is full: dropped, counted;
        either way its captured rows are let go).

        `served_temperatures`: the T* of each generated step (may be shorter than the
        completion, or empty, when the trace is incomplete); `trace_id`: the choice's key on
        the trace channel, under which the engine captured its served rows; `request_id`: the
        request the choice is one of (its n choices share the prompt, so their positions are
        one cluster for the standard errors and one unit of the online bias's held-out split:
        they are scored as one sequence, `request_sequence_id`);
        `request_temperature`: the temperature T_r the engine sampled the choice at (> 0:
        greedy choices are never sampled, `request_args.capturable`), whose target
        softmax(z / T_r) its scores are measured against (`PairScorer.score_live`);
        `correction`: the per-token bias it was served with (None: none), applied before T* in
        its scores as served (loaded from the bias directories,
        `engine_contract.bias_files.load_bias`).
        """
        if not completion_ids:
            self.cancel(trace_id)
            return False
        with self._lock:
            reserved = self._reserved.pop(trace_id, 0.0)
        item = _Item(
            tuple(prompt_ids),
            tuple(completion_ids),
            tuple(served_temperatures),
            request_temperature,
            request_sequence_id(request_id),
            trace_id,
            reserved,
            correction,
        )
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._rows.drop_rows(trace_id)
            with self._lock:
                self._budget.give(reserved)
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

    def close(self, timeout: float = 10.0) -> bool:
        """Stop after the item being scored; items still queued are discarded. Waits up to
        `timeout` seconds for the thread; returns whether it ended (False, logged as a warning:
        it is still scoring, a daemon that may outlive the server's cleanup; what it writes
        then, e.g. an online bias, fails as its folder is gone). True when it never started."""
        if self._thread is None:
            return True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if not ended:
            _LOGGER.warning(
                "The shadow scorer is still scoring %.0f s after close; it is left to end alone",
                timeout,
            )
        self._thread = None
        return ended

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
        scoreboard; the scoring thread's CPU seconds; the CPU budget: its share, whether it is
        still the warm-up's, its credit, the cost per position it reserves), whether the
        scoring thread runs, and for
        how long the item being scored has taken so far (`busy_for_s`, None when idle: a large
        value means a hung scorer, whose queue then fills and drops);
        the live scoreboard (None before the first scored request), the clean backend's
        own status (e.g. a remote clean server's failures and last error) and the captured
        served rows dropped, by reason (`TraceSource.capture_drops`)."""
        with self._lock:
            counts = dict(self._counts)
            seconds = dict(self._seconds)
            since = self._scoring_since
            scoreboard = self._scoreboard_result
            budget = {
                "cpu_share": self._budget.share,
                "horizon_s": self._budget.horizon_s,
                "warm_up": not self._warmed_up,
                "cores": self._budget.cores,
                "credit_s": self._budget.credit,
                "cost_per_position_s": self._cost_per_position_s,
            }
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
            "nice": self._nice if self._warmed_up else 0,
            "budget": budget,
            "scoreboard": scoreboard,
            "clean_backend": self._scorer.clean_status(),
            "capture_dropped_rows": self._rows.capture_drops(),
        }

    def _loop(self) -> None:
        """Score items until the `None` sentinel. A failure anywhere in scoring, estimation or
        publication drops that item (counted, reason `error`) and never ends the loop. Each
        item's CPU time settles its reservation in the budget."""
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        while True:
            item = self._queue.get()
            cpu = time.thread_time()
            scored = 0
            try:
                if item is None:
                    return
                with self._lock:
                    self._scoring_since = time.monotonic()
                scored = self._score(item)
            except Exception:
                _LOGGER.exception("Shadow scoring failed; the request is dropped from estimation")
                with self._lock:
                    self._counts["dropped_error"] += 1
                self._metrics.shadow_requests_dropped.labels(reason="error").inc()
            finally:
                if item is not None:
                    self._settle(item, time.thread_time() - cpu, scored)
                with self._lock:
                    self._scoring_since = None
                self._queue.task_done()

    def _settle(self, item: _Item, thread_cpu_s: float, scored: int) -> None:
        """Replace the item's reservation by its CPU time (the scoring thread's, times the
        torch threads: their intra-op share of the work is about equal) and, when it scored
        `scored` > 0 positions, move the cost per position the next reservations assume a
        quarter of the way to this item's."""
        spent = thread_cpu_s * (self._threads or 1)
        with self._lock:
            self._seconds["cpu"] += spent
            self._budget.give(item.reserved_s - spent)
            if scored:
                measured = spent / scored
                self._cost_per_position_s += 0.25 * (measured - self._cost_per_position_s)

    def _end_warm_up(self) -> None:
        """The first policy is out: the steady budget, and the scoring thread below the
        engine's priority (see the class docstring)."""
        with self._lock:
            self._warmed_up = True
            self._budget.set_share(self._cpu_share, STEADY_HORIZON_S)
        if self._nice:
            thread = threading.get_native_id()
            try:
                current = os.getpriority(os.PRIO_PROCESS, thread)
                os.setpriority(os.PRIO_PROCESS, thread, min(19, current + self._nice))
            except OSError as error:
                _LOGGER.warning("Cannot lower the shadow scorer's priority: %s", error)

    def _score(self, item: _Item) -> int:
        """Score one item; the positions scored (0: dropped)."""
        waiting = time.perf_counter()
        expected = min(len(item.completion_ids), self._positions)
        captured = self._rows.take_rows(item.trace_id, expected, self._rows_timeout_s)
        started = time.perf_counter()
        self._add_seconds("rows_wait", started - waiting)
        if captured is None or not len(captured.steps):
            with self._lock:
                self._counts["dropped_not_captured"] += 1
            self._metrics.shadow_requests_dropped.labels(reason="not_captured").inc()
            return 0
        sequence = ScoringSequence(
            token_ids=[*item.prompt_ids, *item.completion_ids],
            prompt_length=len(item.prompt_ids),
            sequence_id=item.sequence_id,
        )
        served = ServedRows(torch.from_numpy(captured.steps), torch.from_numpy(captured.rows))
        correction = item.correction
        live = self._scorer.score_live(
            sequence,
            item.served_temperatures,
            served,
            self._bias_rows,
            request_temperature=item.request_temperature,
            kl_curve=self._estimator.reads_kl_curves,
            bias=None if correction is None else load_bias(correction.bias),
        )
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
            if not self._warmed_up:
                self._end_warm_up()
        self._add_seconds("estimation", time.perf_counter() - scored)
        return len(live.records)

    def _add_seconds(self, part: str, seconds: float) -> None:
        with self._lock:
            self._seconds[part] += seconds

    def _observe(self, live: LiveScores, elapsed: float) -> None:
        count = len(live.records)
        with self._lock:
            self._counts["scored"] += 1
            self._counts["tokens"] += count
            self._seconds["scoring"] += elapsed
        self._metrics.observe_scored(
            count, elapsed, {"one": live.at_one.kld.tolist(), "served": live.at_served.kld.tolist()}
        )
