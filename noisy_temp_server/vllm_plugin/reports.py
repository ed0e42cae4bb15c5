"""From the device to the host off the step loop: per-step traces, summaries, histogram counts.

`SlotTuning` stages, per step, one asynchronous device→host copy of its cumulative state (the
per-slot summaries and the histogram counts, one flat float64 tensor) and, only while some slot
is traced, one copy of the step's ``[slot, step, T*, traced]`` rows. A `Reporter` background
thread waits for those copies (a CUDA event on GPU; nothing to wait for on CPU), then:

- sends the step traces of traced slots (``nts_trace`` or the server's shadow sample) on the
  trace channel;
- sends the cumulative summary (sum, count, min, max of T*) of every slot whose summary changed
  since the last report; each message is cumulative for one *occupancy* of a slot, so a lost or
  skipped snapshot loses nothing and the collector merges the occupancies of one request
  (preemption);
- adds the histogram counts that grew since the last report to ``nts_step_temperature``.

The step loop never waits: a snapshot goes into whichever of two host buffers the thread is not
reading. Reports lag the device by at most one ``interval_s`` (default 20 ms). Model Runner V2
has no hook for a finished request, which is why summaries are sent when they change rather than
when the request ends.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from noisy_temp_server.vllm_plugin.metrics import STEP_TEMPERATURE_BUCKETS, StepTemperatureMetrics
from noisy_temp_server.vllm_plugin.trace_channel import TraceSender

__all__ = ["MAX_LABELS", "SUMMARY_COLUMNS", "Occupants", "Reporter", "StateLayout"]

_LOGGER = logging.getLogger(__name__)
SUMMARY_COLUMNS = 4  # sum, count, min, max of the counted T* of a slot's occupant
MAX_LABELS = 256
Occupants = tuple[tuple[str | None, int], ...]
"""Each slot's (trace id or None, occupancy serial)."""


@dataclass(frozen=True)
class StateLayout:
    """Where each part lives in the flat float64 state of ``slots`` slots: the summaries
    ``[slots, 4]``, the histogram counts ``[MAX_LABELS, buckets + 1]``, the histogram sums
    ``[MAX_LABELS]`` and the number of bad rows ``[1]``."""

    slots: int
    width: int = len(STEP_TEMPERATURE_BUCKETS) + 1

    @property
    def summary_end(self) -> int:
        return self.slots * SUMMARY_COLUMNS

    @property
    def counts_end(self) -> int:
        return self.summary_end + MAX_LABELS * self.width

    @property
    def size(self) -> int:
        return self.counts_end + MAX_LABELS + 1

    def split(self, state: Any) -> tuple[Any, Any, Any, Any]:
        """(summary [slots, 4], counts [labels, width], sums [labels], bad [1]) views of a
        flat numpy array or tensor."""
        return (
            state[: self.summary_end].reshape(self.slots, SUMMARY_COLUMNS),
            state[self.summary_end : self.counts_end].reshape(MAX_LABELS, self.width),
            state[self.counts_end : self.size - 1],
            state[self.size - 1 :],
        )


class _HostCopy:
    """A device tensor's asynchronous copy into (pinned) host memory and its completion."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor | None = None) -> None:
        on_device = source.device.type == "cuda"
        if target is None:
            target = torch.empty(source.shape, dtype=source.dtype, pin_memory=on_device)
        target.copy_(source, non_blocking=on_device)
        self.host = target
        self._event: torch.cuda.Event | None = None
        if on_device:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> np.ndarray:
        """Block (the calling thread only) until the copy is done; the host values."""
        if self._event is not None:
            self._event.synchronize()
        return self.host.numpy()


class Reporter:
    """Delivers what `SlotTuning` stages (see the module docstring). Thread-safe for one
    producer (the engine's step loop) and its own reader thread."""

    def __init__(
        self,
        sender: TraceSender | None,
        metrics: StepTemperatureMetrics,
        *,
        layout: StateLayout,
        interval_s: float = 0.02,
    ) -> None:
        self.sender = sender
        self.metrics = metrics
        self.layout = layout
        self.interval_s = interval_s
        self.bad_rows = 0
        self._labels: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._latest: tuple[int, _HostCopy, Occupants] | None = None
        self._reading: int | None = None
        self._occupants: Occupants = ((None, 0),) * layout.slots
        self._traces: deque[tuple[_HostCopy, Occupants]] = deque()
        self._sent_counts = np.zeros(layout.slots)
        self._sent_occupants: Occupants = self._occupants
        self._sent_state = np.zeros(layout.size)

    # -- producer side (the step loop) -----------------------------------------------------

    def name_label(self, label: int, key: tuple[str, str]) -> None:
        """Histogram label id ``label`` stands for (step bucket label, rule)."""
        self._labels[label] = key

    def set_occupants(self, occupants: Occupants) -> None:
        """Each slot's (trace id or None, occupancy serial) from the next staged copy on."""
        self._occupants = occupants

    def stage_snapshot(self, state: torch.Tensor) -> None:
        """Copy the cumulative flat state (`StateLayout`) to the host asynchronously."""
        with self._lock:
            index = 0 if self._reading != 0 else 1
            buffer = self._buffers[index]
            copy = _HostCopy(state, buffer)
            self._buffers[index] = copy.host
            self._latest = (index, copy, self._occupants)
        self._start()

    def stage_trace(self, rows: torch.Tensor) -> None:
        """Copy one step's ``[4, R]`` rows (slot, step, T*, traced flag) to the host."""
        with self._lock:
            self._traces.append((_HostCopy(rows), self._occupants))
        self._start()

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
        """Deliver everything staged so far (waits for the pending copies)."""
        with self._lock:
            traces = list(self._traces)
            self._traces.clear()
            latest, self._latest = self._latest, None
            if latest is not None:
                self._reading = latest[0]
        for copy, occupants in traces:
            self._send_trace(copy.wait(), occupants)
        if latest is not None:
            try:
                self._deliver_snapshot(latest[1].wait(), latest[2])
            finally:
                with self._lock:
                    self._reading = None

    def close(self) -> None:
        """Stop the thread after a last `flush`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _send_trace(self, rows: np.ndarray, occupants: Occupants) -> None:
        if self.sender is None:
            return
        slots, steps, temperatures, _ = rows[:, rows[3] > 0]
        records = [
            (trace_id, int(step), float(t))
            for slot, step, t in zip(
                slots.tolist(), steps.tolist(), temperatures.tolist(), strict=True
            )
            if (trace_id := occupants[int(slot)][0]) is not None
        ]
        if records:
            self.sender.send_step(records)

    def _deliver_snapshot(self, state: np.ndarray, occupants: Occupants) -> None:
        summary, counts, sums, bad = self.layout.split(state)
        _, sent_counts, sent_sums, sent_bad = self.layout.split(self._sent_state)
        self._send_summaries(summary, occupants)
        self.bad_rows += int(bad[0] - sent_bad[0])
        new_counts, new_sums = counts - sent_counts, sums - sent_sums
        for label, (step_label, rule) in self._labels.items():
            if new_counts[label].any():
                self.metrics.add(rule, step_label, new_counts[label], float(new_sums[label]))
        self._sent_state = state.copy()

    def _send_summaries(self, summary: np.ndarray, occupants: Occupants) -> None:
        changed = set(np.flatnonzero(summary[:, 1] != self._sent_counts).tolist())
        if occupants is not self._sent_occupants:
            pairs = zip(occupants, self._sent_occupants, strict=True)
            changed.update(slot for slot, (now, before) in enumerate(pairs) if now != before)
        records = []
        for slot in sorted(changed):
            trace_id, serial = occupants[slot]
            total, count, low, high = summary[slot].tolist()
            if trace_id is not None and count > 0:
                records.append((trace_id, serial, total, int(count), low, high))
        self._sent_counts = summary[:, 1].copy()
        self._sent_occupants = occupants
        if records and self.sender is not None:
            self.sender.send_summaries(records)
