"""From the device to the host off the step loop: per-step traces, summaries, histogram counts.

`SlotTuning` accumulates, per *cell* (a slot's step bucket), the count and sum of the counted T*
and their extrema, in one flat float64 tensor (`StateLayout`). Per step it stages one
asynchronous device→host copy of that state and, only while some slot is traced, one copy of
the step's ``[slot, step, T*, traced]`` rows. A `Reporter` background thread waits for those
copies (a CUDA event on GPU; nothing to wait for on CPU), then:

- sends the served-logit rows `capture.RowCapture` staged (shadow-sampled requests), first,
  so that a request's rows arrive before the summary that covers their steps; at most
  ``capture_queue_rows`` rows wait, beyond which a step's rows are dropped, counted
  (``capture_dropped_rows``) and announced as dropped;
- sends the step traces of traced slots (``nts_trace`` or the server's shadow sample) on the
  trace channel;
- sends the cumulative summary (sum, count, min, max of T*, reduced over the slot's cells) of
  every slot whose summary changed since the last report; each message is cumulative for one
  *occupancy* of a slot, so a skipped snapshot loses nothing and the collector merges the
  occupancies of one request (preemption);
- adds to ``nts_step_temperature`` what each cell gained since the last report: Δcount
  observations of value Δsum / Δcount, binned on the host. Exact for every rule whose T* is
  constant on a step bucket (off, fixed, sqrt, linear, calibrated); for ``schedule``,
  ``fisher`` and an entropy-dependent ``calibrated`` table, the observations of one request
  and step bucket between two reports (20 ms) are binned at their mean (``_sum`` stays exact).

The step loop never waits: a new snapshot replaces the one not yet read, except a *kept*
snapshot (`SlotTuning` keeps the last state before it resets cells for new occupants), which
is always delivered, in order. Reports lag the device by at most one ``interval_s`` (default
20 ms). Model Runner V2 has no hook for a finished request, which is why summaries are sent when
they change rather than when the request ends.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from noisy_temp_server.step.engine_metrics import STEP_TEMPERATURE_BUCKETS, StepTemperatureMetrics
from noisy_temp_server.step.host_copies import HostCopy, PinnedRows, PinnedTraces

if TYPE_CHECKING:
    from noisy_temp_server.step.capture import CapturedStep

__all__ = ["Occupancy", "Reporter", "StateLayout", "StepSender"]

_LOGGER = logging.getLogger(__name__)
# Binned as the device would bin float32 T*: a value equal to a bound goes into its bucket.
_BUCKET_BOUNDS = np.asarray(STEP_TEMPERATURE_BUCKETS, dtype=np.float32)
_TRACE_DEPTH = 64  # steps of traces waiting for the reporter thread, beyond which one is dropped


class StepSender(Protocol):
    """Where a `Reporter` sends (the engine's: `trace_sender.TraceSender`); each call never
    blocks and says whether the message was queued."""

    def send_step(self, records: Sequence[tuple[str, int, float]]) -> bool: ...

    def send_summaries(
        self, records: Sequence[tuple[str, int, float, int, float, float]]
    ) -> bool: ...

    def send_rows(
        self,
        records: Sequence[tuple[str, int]],
        rows: np.ndarray,
        dropped: Sequence[tuple[str, int]] = (),
        drop_counts: Mapping[str, int] | None = None,
    ) -> bool: ...


@dataclass(frozen=True)
class StateLayout:
    """Where each part lives in the flat float64 state of ``slots`` slots with ``columns`` step
    buckets each: cell ``1 + slot * columns + bucket`` (cell 0 takes rows that are not counted)
    of the accumulators ``[2, cells]`` (count, sum of T*) and of the extrema ``[2, cells]``
    (-min, max of T*; a cell whose T* is constant holds its T* from admission on, so it counts
    only where the cell's count is > 0), then the number of bad rows ``[1]``. Quantities are
    rows, cells columns: a step's ``index_add_`` and ``scatter_reduce_`` along the cells cost
    less than along rows of two."""

    slots: int
    columns: int

    @property
    def cells(self) -> int:
        return 1 + self.slots * self.columns

    @property
    def size(self) -> int:
        return 4 * self.cells + 1

    def split(self, state: Any) -> tuple[Any, Any, Any]:
        """(accumulators [2, cells], extrema [2, cells], bad [1]) views of a flat numpy array
        or tensor."""
        end = 2 * self.cells
        return (
            state[:end].reshape(2, self.cells),
            state[end : 2 * end].reshape(2, self.cells),
            state[2 * end :],
        )

    def initial(self, device: torch.device) -> torch.Tensor:
        """A fresh state: nothing counted (extrema at -inf)."""
        state = torch.zeros(self.size, dtype=torch.float64, device=device)
        self.split(state)[1].fill_(-torch.inf)
        return state

    def by_slot(self, cells: np.ndarray) -> np.ndarray:
        """``[2, cells]`` per-cell values as ``[slots, columns, 2]`` (cell 0 dropped)."""
        return cells[:, 1:].reshape(2, self.slots, self.columns).transpose(1, 2, 0)

    def summaries(self, state: np.ndarray) -> np.ndarray:
        """``[slots, 4]`` (sum, count, min, max) of each slot's counted T* (min = +inf, max =
        -inf for a slot with none)."""
        accumulators, extrema, _ = self.split(state)
        cells = self.by_slot(accumulators)
        reached = np.where(cells[..., :1] > 0, self.by_slot(extrema), -np.inf)
        count, total = cells.sum(axis=1).T
        low, high = reached.max(axis=1).T
        return np.stack((total, count, -low, high), axis=1)


@dataclass(frozen=True)
class Occupancy:
    """Who holds each slot from a staged snapshot on: ``ids[slot]`` = (trace id or None,
    occupancy serial), ``labels[slot, bucket]`` = the histogram label id of the slot's step
    bucket (-1: not observed, e.g. an untuned slot)."""

    ids: tuple[tuple[str | None, int], ...]
    labels: np.ndarray = field(compare=False)


@dataclass
class _Snapshot:
    copy: HostCopy
    occupancy: Occupancy
    layout: StateLayout
    keep: bool


class Reporter:
    """Delivers what `SlotTuning` stages (see the module docstring). Thread-safe for one
    producer (the engine's step loop) and its own reader thread."""

    def __init__(
        self,
        sender: StepSender | None,
        metrics: StepTemperatureMetrics,
        *,
        slots: int,
        interval_s: float = 0.02,
        capture_queue_rows: int = 64,
    ) -> None:
        self.sender = sender
        self.capture_queue_rows = capture_queue_rows
        self.capture_dropped_rows = 0
        self._captures: deque[tuple[HostCopy, CapturedStep, bool]] = deque()
        self._pinned: PinnedRows | None = None
        self._capture_rows = 0
        self.metrics = metrics
        self.interval_s = interval_s
        self.bad_rows = 0
        self._labels: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._delivering = threading.Lock()  # one `flush` at a time, so deliveries keep order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshots: deque[_Snapshot] = deque()
        self._spare: list[torch.Tensor] = []
        self._occupancy = Occupancy(((None, 0),) * slots, np.full((slots, 1), -1))
        self._traces: PinnedTraces | None = None
        self.trace_dropped_steps = 0
        self._sent: tuple[np.ndarray, Occupancy, StateLayout] | None = None

    # -- producer side (the step loop) -----------------------------------------------------

    def name_label(self, label: int, key: tuple[str, str]) -> None:
        """Histogram label id ``label`` stands for (step bucket label, rule)."""
        self._labels[label] = key

    def set_occupancy(self, occupancy: Occupancy) -> None:
        """Who holds each slot, from the next staged copy on."""
        self._occupancy = occupancy

    def prepare(self, vocab: int, device: torch.device) -> None:
        """Allocate the host memory of traces and captured rows (``vocab`` wide) for steps on
        ``device`` now, so that no step pays for it (pinned allocations take milliseconds)."""
        with self._lock:
            if self._traces is None:
                self._traces = PinnedTraces(_TRACE_DEPTH, len(self._occupancy.ids), device)
            if device.type == "cuda" and self._pinned is None:
                self._pinned = PinnedRows(self.capture_queue_rows, vocab, pin=True)

    def stage_snapshot(
        self, state: torch.Tensor, layout: StateLayout, *, keep: bool = False
    ) -> None:
        """Copy the cumulative flat state (``layout``) to the host asynchronously. It replaces
        the previous snapshot if that was not read yet, unless that one is ``keep``."""
        with self._lock:
            target = None
            pending = self._snapshots[-1] if self._snapshots else None
            if pending is not None and not (pending.keep or keep) and pending.layout is layout:
                # The common case, once per step: copy over the snapshot not read yet.
                pending.copy.refresh(state)
                pending.occupancy = self._occupancy
                return
            if pending is not None and not pending.keep:
                target = self._snapshots.pop().copy.host
            elif self._spare:
                target = self._spare.pop()
            snapshot = _Snapshot(HostCopy(state, target), self._occupancy, layout, keep)
            self._snapshots.append(snapshot)
        self._start()

    def stage_trace(self, rows: torch.Tensor) -> None:
        """Copy one step's ``[4, R]`` rows (slot, step, T*, traced flag) to the host, into
        slots allocated once; a step that finds them all waiting for the reader is dropped
        (counted in ``trace_dropped_steps``)."""
        with self._lock:
            if self._traces is None:
                self._traces = PinnedTraces(_TRACE_DEPTH, len(self._occupancy.ids), rows.device)
            if not self._traces.stage(rows, self._occupancy):
                self.trace_dropped_steps += 1
                if self.trace_dropped_steps == 1:
                    _LOGGER.warning(
                        "noisy-temp-server: the reporter thread is %d steps behind; dropping "
                        "per-step traces (counted in Reporter.trace_dropped_steps)",
                        _TRACE_DEPTH,
                    )
        self._start()

    def stage_capture(self, step: CapturedStep) -> None:
        """Copy one step's captured rows to the host asynchronously (on CUDA into the pinned
        rows allocated once), unless ``capture_queue_rows`` rows already wait: then they are
        dropped (counted, and announced as dropped)."""
        count = len(step.steps)
        with self._lock:
            self.capture_dropped_rows += step.queue_full
            target = None
            if count and self._capture_rows + count <= self.capture_queue_rows:
                target = self._capture_target(step.rows)
            if count and target is None:
                self.capture_dropped_rows += count
                lost = list(zip(step.trace_ids, step.steps, strict=True))
                step = replace(
                    step, trace_ids=[], steps=[], rows=step.rows[:0], dropped=step.dropped + lost
                )
                count = 0
            held = count > 0 and target is not step.rows
            self._captures.append((HostCopy(step.rows, target, own=True), step, held))
            self._capture_rows += count
        self._start()

    def capture_room(self) -> int:
        """How many captured rows may still wait for the reporter thread (`stage_capture`
        takes at least as many)."""
        return self.capture_queue_rows - self._capture_rows

    def _capture_target(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Where ``rows`` [n > 0, V] go on the host: a block of the pinned rows on CUDA (None:
        none free), ``rows`` themselves on the CPU."""
        if rows.device.type != "cuda":
            return rows
        width = rows.shape[1]
        if self._pinned is None or self._pinned.buffer.shape[1] != width:
            if self._capture_rows:
                return None
            self._pinned = PinnedRows(self.capture_queue_rows, width, pin=True)
        return self._pinned.take(rows.shape[0])

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nts-reporter", daemon=True)
            self._thread.start()

    # -- reader side ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # never let reporting kill the thread silently
                _LOGGER.exception("noisy-temp-server: reporting T* failed")

    def flush(self) -> None:
        """Deliver everything staged so far (waits for the pending copies). Safe to call beside
        the reporter thread: deliveries stay in staging order."""
        with self._delivering:
            self._deliver_staged()

    def _deliver_staged(self) -> None:
        with self._lock:
            captures = list(self._captures)
            self._captures.clear()
            traces = [] if self._traces is None else self._traces.waiting()
            snapshots = list(self._snapshots)
            self._snapshots.clear()
        for copy, step, held in captures:
            rows = copy.wait()
            if held:  # the sender may keep the array: the pinned block is taken again
                rows = rows.copy()
            with self._lock:
                self._capture_rows -= len(step.steps)
                if held:
                    self._pinned.release()  # type: ignore[union-attr]
            if self.sender is not None:
                records = list(zip(step.trace_ids, step.steps, strict=True))
                counts = {**step.drop_counts, "queue_full": self.capture_dropped_rows}
                self.sender.send_rows(records, rows, step.dropped, counts)
        if traces:
            assert self._traces is not None
            for slot, count, occupancy in traces:
                self._send_trace(self._traces.read(slot, count), occupancy)
            with self._lock:
                self._traces.release(len(traces))
        for snapshot in snapshots:
            self._deliver_snapshot(snapshot.copy.wait(), snapshot.occupancy, snapshot.layout)
        with self._lock:
            self._spare = [snapshot.copy.host for snapshot in snapshots[-2:]]

    def close(self) -> None:
        """Stop the thread after a last `flush`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _send_trace(self, rows: np.ndarray, occupancy: Occupancy) -> None:
        if self.sender is None:
            return
        slots, steps, temperatures, _ = rows[:, rows[3] > 0]
        records = [
            (trace_id, int(step), float(t))
            for slot, step, t in zip(
                slots.tolist(), steps.tolist(), temperatures.tolist(), strict=True
            )
            if (trace_id := occupancy.ids[int(slot)][0]) is not None
        ]
        if records:
            self.sender.send_step(records)

    def _deliver_snapshot(
        self, state: np.ndarray, occupancy: Occupancy, layout: StateLayout
    ) -> None:
        accumulators, _, bad = layout.split(state)
        summary = layout.summaries(state)
        cells = layout.by_slot(accumulators)
        sent_bad, previous, changed = 0.0, np.zeros_like(cells), summary[:, 1] > 0
        if self._sent is not None:
            sent_state, sent_occupancy, sent_layout = self._sent
            sent_bad = float(sent_layout.split(sent_state)[2][0])
            if sent_layout == layout:
                same = np.fromiter(
                    (a == b for a, b in zip(occupancy.ids, sent_occupancy.ids, strict=True)),
                    dtype=bool,
                    count=layout.slots,
                )
                previous = layout.by_slot(layout.split(sent_state)[0]) * same[:, None, None]
                changed = ~same | (summary[:, 1] != layout.summaries(sent_state)[:, 1])
        self._send_summaries(summary, changed, occupancy)
        self._observe(cells - previous, occupancy.labels)
        self.bad_rows += int(bad[0] - sent_bad)
        self._sent = (state.copy(), occupancy, layout)

    def _observe(self, gained: np.ndarray, labels: np.ndarray) -> None:
        """Add each cell's gain ``[slots, columns, 2]`` (count, sum) to the histogram."""
        count, total = gained[..., 0], gained[..., 1]
        observed = (count > 0) & (labels >= 0)
        if not observed.any():
            return
        count, total, label = count[observed], total[observed], labels[observed]
        bucket = np.searchsorted(_BUCKET_BOUNDS, (total / count).astype(np.float32))
        counts = np.zeros((len(self._labels), len(_BUCKET_BOUNDS) + 1))
        np.add.at(counts, (label, bucket), count)
        sums = np.bincount(label, weights=total, minlength=len(self._labels))
        for label_id in np.unique(label).tolist():
            step_label, rule = self._labels[label_id]
            self.metrics.add(rule, step_label, counts[label_id], float(sums[label_id]))

    def _send_summaries(
        self, summary: np.ndarray, changed: np.ndarray, occupancy: Occupancy
    ) -> None:
        records = []
        for slot in np.flatnonzero(changed).tolist():
            trace_id, serial = occupancy.ids[slot]
            total, count, low, high = summary[slot].tolist()
            if trace_id is not None and count > 0:
                records.append((trace_id, serial, total, int(count), low, high))
        if records and self.sender is not None:
            self.sender.send_summaries(records)
