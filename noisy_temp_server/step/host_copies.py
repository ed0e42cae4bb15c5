"""Device→host copies that never make the step loop wait: what `reports.Reporter` stages.

- `HostCopy`: one asynchronous copy of a device tensor into pinned host memory and its event
  (on the CPU nothing is copied or waited for);
- `PinnedTraces`: the per-step traces of traced slots, copied into host slots allocated once
  (``depth`` steps), instead of a pinned allocation and an event per step;
- `PinnedRows`: the captured served rows' host memory, allocated once (``queue_rows`` rows) and
  handed out first in, first out, instead of a pinned allocation per step;
- `PinnedUploads`: the other way, the captured rows' indices, from pinned slots allocated once.

Every copy is staged on the step loop's thread, so it is ordered after the step that wrote its
source on the same stream; the reporter's own thread only waits on events and reads.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

__all__ = ["HostCopy", "PinnedRows", "PinnedTraces", "PinnedUploads"]


class HostCopy:
    """A device tensor's asynchronous copy into (pinned) host memory and its completion.
    ``target``: host memory to copy into (its shape; None: allocated); ``own``: ``source`` is
    a fresh tensor nobody else writes, so on the CPU it is used as is. An empty ``source`` is
    neither copied nor waited for."""

    def __init__(
        self, source: torch.Tensor, target: torch.Tensor | None = None, *, own: bool = False
    ) -> None:
        on_device = source.device.type == "cuda" and source.numel() > 0  # else nothing to copy
        if own and not on_device:
            target = (
                source
                if source.device.type == "cpu"
                else torch.empty(source.shape, dtype=source.dtype)
            )
        elif target is None or target.shape != source.shape:
            target = torch.empty(source.shape, dtype=source.dtype, pin_memory=on_device)
        self.host = target
        self._event = torch.Event(device=source.device) if on_device else None
        if target is not source and source.numel():
            self.refresh(source)

    def refresh(self, source: torch.Tensor) -> None:
        """Copy ``source`` (the shape of `host`) again, over the previous copy."""
        self.host.copy_(source, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()

    def wait(self) -> np.ndarray:
        """Block (the calling thread only) until the copy is done; the host values."""
        if self._event is not None:
            self._event.synchronize()
        return self.host.numpy()


class PinnedTraces:
    """Host slots for the traces of ``depth`` steps of at most ``capacity`` rows on
    ``device`` (pinned memory and an event per slot on CUDA), allocated once: each step's
    ``[4, R]`` trace is copied into the next free slot without a wait, and the reader takes
    them first in, first out. Not thread-safe: the `Reporter` holds its lock around each
    call."""

    def __init__(self, depth: int, capacity: int, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self.host = torch.empty(depth, 4 * max(capacity, 1), pin_memory=self._cuda)
        self._events = [torch.Event(device=device) if self._cuda else None for _ in range(depth)]
        self._waiting: deque[tuple[int, int, Any]] = deque()  # (slot, rows, occupancy)
        self._next = 0

    def stage(self, trace: torch.Tensor, occupancy: Any) -> bool:
        """Copy ``trace`` [4, R] (on `device`) into the next free slot, with the ``occupancy``
        it was written under; False, copying nothing, when every slot waits for the reader
        (or R is over the capacity while some do)."""
        rows = trace.shape[1]
        depth, width = self.host.shape
        if len(self._waiting) == depth or (4 * rows > width and self._waiting):
            return False
        if 4 * rows > width:
            self.host = torch.empty(depth, 4 * rows, pin_memory=self._cuda)
        slot = self._next
        self._next = (slot + 1) % depth
        self.host[slot, : 4 * rows].view(4, rows).copy_(trace, non_blocking=self._cuda)
        event = self._events[slot]
        if event is not None:
            event.record()
        self._waiting.append((slot, rows, occupancy))
        return True

    def waiting(self) -> list[tuple[int, int, Any]]:
        """The slots staged and not yet released, oldest first."""
        return list(self._waiting)

    def read(self, slot: int, rows: int) -> np.ndarray:
        """A slot's ``[4, rows]`` trace, once its copy is done (blocks the calling thread
        only); valid until `release`."""
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return self.host[slot, : 4 * rows].numpy().reshape(4, rows)

    def release(self, count: int) -> None:
        """Free the ``count`` oldest slots."""
        for _ in range(count):
            self._waiting.popleft()


class PinnedRows:
    """``rows`` host rows of ``width`` float32 (pinned with ``pin``), allocated once and handed
    out as contiguous blocks first in, first out: `take` a block, `release` the oldest."""

    def __init__(self, rows: int, width: int, *, pin: bool) -> None:
        self.buffer = torch.empty(rows, width, pin_memory=pin)
        self._blocks: deque[tuple[int, int]] = deque()  # (start, count) in use, oldest first

    def take(self, count: int) -> torch.Tensor | None:
        """A free block of ``count`` > 0 rows, or None when none is free (nothing is
        taken)."""
        start = self._free_start(count)
        if start is None:
            return None
        self._blocks.append((start, count))
        return self.buffer[start : start + count]

    def release(self) -> None:
        """Free the oldest block taken."""
        self._blocks.popleft()

    def _free_start(self, count: int) -> int | None:
        capacity = self.buffer.shape[0]
        if not self._blocks:
            return 0 if count <= capacity else None
        oldest = self._blocks[0][0]
        newest, taken = self._blocks[-1]
        end = newest + taken
        if newest >= oldest:  # not wrapped: after the newest block, else from row 0
            if end + count <= capacity:
                return end
            return 0 if count <= oldest else None
        return end if end + count <= oldest else None


class PinnedUploads:
    """Small int64 vectors (at most ``width`` entries) uploaded to ``device`` (CUDA) from
    ``depth`` pinned host slots allocated once, each reused once its last copy is done (an
    event per slot), instead of a pinned allocation per upload."""

    def __init__(self, depth: int, width: int, device: torch.device) -> None:
        self.host = torch.empty(depth, width, dtype=torch.int64, pin_memory=True)
        self._host_values = self.host.numpy()
        self.device_slots = torch.empty(depth, width, dtype=torch.int64, device=device)
        self._events = [torch.Event(device=device) for _ in range(depth)]
        self._recorded = [False] * depth
        self._next = 0

    def upload(self, values: np.ndarray) -> torch.Tensor | None:
        """``values`` on the device, copied without a wait; None (nothing done) when there are
        more than ``width`` or the next slot's last copy is not done yet."""
        count, slot = len(values), self._next
        depth, width = self.host.shape
        if count > width or (self._recorded[slot] and not self._events[slot].query()):
            return None
        self._next = (slot + 1) % depth
        self._host_values[slot, :count] = values
        target = self.device_slots[slot, :count]
        target.copy_(self.host[slot, :count], non_blocking=True)
        self._events[slot].record()
        self._recorded[slot] = True
        return target
