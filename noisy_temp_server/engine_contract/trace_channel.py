"""What the API process reads from vLLM's engine process through the trace channel: the
contract its receiving end (`server.trace_collector.TraceCollector`) and its readers share.

The logits processor runs in vLLM's engine process, the HTTP response is built in the API
process. Between them runs one ZeroMQ PUSH → PULL channel: the engine's
`trace_sender.TraceSender` sends the messages of `trace_wire`; the API process's collector
receives them. `TraceSource` is what the API process's readers need of the collector: the HTTP
layer waits for a choice's T* (`wait_for`, a `TraceReport`); the shadow scorer (`online`) takes
captured rows (`take_rows`, `CapturedRows`) and the drop counts (`capture_drops`). The readers
are handed the collector (or a test's fake) as a `TraceSource`, so none of them imports the
API process's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "CapturedRows",
    "TraceReport",
    "TraceSource",
]


@dataclass(frozen=True)
class TraceReport:
    """What arrived for one request: its T* summary and, when traced, the per-step T*.

    ``steps``: how many steps the summary covers; ``t_mean``/``t_min``/``t_max`` are None when
    no step arrived. ``trace``: the T* of steps 0.. in order (empty when not traced or lost).
    """

    steps: int = 0
    t_mean: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    trace: tuple[float, ...] = ()


@dataclass(frozen=True)
class CapturedRows:
    """The served-logit rows that arrived for one request: ``steps`` int64 ``[n]`` ascending
    (generation steps), ``rows`` float32 ``[n, V]`` (the row of ``steps[i]`` at ``i``)."""

    steps: np.ndarray
    rows: np.ndarray


class TraceSource(Protocol):
    """What the API process reads from the engine through the channel (the server's
    `TraceCollector`; a test's fake): the HTTP layer waits for a choice's T* report (`wait_for`)
    or lets it go (`forget`, `drop_rows`); the shadow scorer takes a sampled choice's captured
    rows (`take_rows`, `drop_rows`) and shows the drop counts (`capture_drops`). See
    `server.trace_collector.TraceCollector` for each method's contract."""

    async def wait_for(
        self, trace_id: str, n_steps: int, timeout: float, *, want_trace: bool = False
    ) -> TraceReport: ...

    def forget(self, trace_id: str) -> None: ...

    def take_rows(self, trace_id: str, n_steps: int, timeout: float) -> CapturedRows | None: ...

    def drop_rows(self, trace_id: str) -> None: ...

    def capture_drops(self) -> dict[str, int]: ...
