"""The served logits of shadow-sampled requests, captured in the engine for the shadow scorer
(free of vLLM: `vllm_plugin.capture` admits the requests from vLLM's sampling parameters, under
the trace id of their `request_args.AdmittedRequest`).

The server marks the choices its shadow scorer samples with ``nts_capture`` and a trace id
(`request_args`); for those requests (tuned or not, never greedy ones) the temperature
processor hands every logits row it sees to `RowCapture.capture`, *before* it applies T*
(and before anything else of ours touches the row). The rows are what vLLM samples from,
before any temperature:

- Model Runner V2 calls custom processors before the request temperature: the row is the
  unscaled served logits z̃, copied exactly;
- the V1 runner calls argmax-invariant processors after dividing by T_request: the row is
  multiplied back by T_request (host-known per row). In float32 that adds at most two roundings,
  |fl(fl(z̃/T)·T) − z̃| ≤ 2·2⁻²⁴·|z̃| per entry (``tests/unit/test_capture.py`` holds it), far
  below what any statistic of the scorer resolves.

Both runners apply penalties, logit bias and the like before, so a row includes them; the
server samples only requests without them (`engine_contract.request_args.capturable`). Our
runtime-noise processor always runs before the capture (it hands its noise to the T* processor
where vLLM's order would put it after, see `runtime_noise`): its noise is exactly the served
side's difference of the runtime-noise pair.

Cost and bounds (`CaptureBounds`, from the engine's configuration ``NTS_CAPTURE_*``, which the
server sets from its settings ``capture_*``: `CaptureBounds.from_engine_config`):

- no captured request in the batch: one host-side count is read, nothing else (no device work,
  no sync); rows are chosen by host-known indices (V1: batch rows; V2: ``ctx.idx_mapping_np``);
- at most ``rows_per_step`` rows per step (rotating over the capturing requests when more want
  one) and only generation steps ``0 .. positions - 1`` of a request; a row that is not taken is
  *dropped*: counted (`dropped`, by reason) and announced to the scorer, so it never waits for
  it;
- the chosen rows are gathered on the device (one ``index_select``; their indices go up from
  pinned memory on CUDA) and copied to the host asynchronously (into pinned memory on CUDA)
  by `reports.Reporter`, whose background thread sends them on the trace channel; at most
  ``queue_rows`` rows wait for it, beyond which rows are dropped and counted
  (`reports.Reporter.capture_dropped_rows`): the step loop never blocks.

The drop counts travel with the rows (cumulative, by reason: `trace_wire.DROP_REASONS`), so
the API process shows them on ``/v1/nts/status`` (``shadow.capture_dropped_rows``) and as
``nts_capture_dropped_rows_total{reason}`` (`server.trace_collector.TraceCollector.capture_drops`).

Full float32 rows rather than top-k + log-sum-exp: they are exact, every statistic of the scorer
(KL curves, the scoreboard's Δp and same-top) reads the whole row, and at SmolLM's 49 152 tokens
a row is 192 KiB, so the default bound (8 rows per step) moves at most 1.5 MiB per step.

Under Model Runner V2 with speculative decoding (several rows per request) nothing is captured
(counted under ``speculative``). Faults in capture are logged and never reach serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from noisy_temp_server.devices import upload
from noisy_temp_server.step.batch_rows import RowColumns
from noisy_temp_server.step.host_copies import PinnedUploads

if TYPE_CHECKING:
    from noisy_temp_server.engine_contract.engine_env import EngineConfig

__all__ = ["CaptureBounds", "CaptureSink", "CapturedStep", "RowCapture"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureBounds:
    """At most ``rows_per_step`` rows per step, steps ``0 .. positions - 1`` of a request, and
    ``queue_rows`` rows waiting for the reporter thread."""

    rows_per_step: int = 8
    positions: int = 128
    queue_rows: int = 64

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> CaptureBounds:
        """The bounds of the engine's configuration (``NTS_CAPTURE_*``, which the server sets
        from its settings of the same names)."""
        return cls(
            rows_per_step=config.capture_rows_per_step,
            positions=config.capture_positions,
            queue_rows=config.capture_queue_rows,
        )


@dataclass(frozen=True)
class CapturedStep:
    """One step's captured rows on their way to the host: ``rows`` ``[n, V]`` float32 (device),
    the trace id and generation step of each, the (trace id, step) of rows dropped at this
    step (the scorer stops waiting for them), and the capture's cumulative drops by reason."""

    trace_ids: list[str]
    steps: list[int]
    rows: torch.Tensor
    dropped: list[tuple[str, int]]
    drop_counts: dict[str, int]
    queue_full: int = 0
    """Rows of this step not gathered because the reporter's queue had no room (they are in
    ``dropped``; the reporter counts them)."""


class CaptureSink(Protocol):
    """Where `RowCapture` stages each step's captured rows (`reports.Reporter`)."""

    def stage_capture(self, step: CapturedStep) -> None: ...

    def capture_room(self) -> int:
        """How many rows a `stage_capture` now would take (it may take more, never fewer)."""
        ...


class RowCapture:
    """Which requests are captured, keyed by V1 batch row or V2 slot (``capacity`` keys), and
    the per-step capture (see the module docstring). ``logits_scaled``: the rows arrive divided
    by T_request (V1) and are multiplied back. ``reporter``: where the rows go (None: nothing
    is captured). ``pin_memory``: upload the step's row indices from pinned memory (CUDA)."""

    def __init__(
        self,
        capacity: int,
        reporter: CaptureSink | None,
        bounds: CaptureBounds,
        *,
        logits_scaled: bool,
        pin_memory: bool = False,
    ) -> None:
        self.reporter = reporter
        self.bounds = bounds
        self.logits_scaled = logits_scaled
        self.dropped = {"rows_per_step": 0, "speculative": 0}
        self.keys = RowColumns(capacity)
        _, self._temperature = self.keys.array(torch.float32, 1.0)
        self._trace_ids = self.keys.objects()
        self._outputs = self.keys.objects()
        self._turn = 0
        self._pin = pin_memory
        self._row_uploads: PinnedUploads | None = None

    @property
    def active(self) -> int:
        """How many keys capture (0: `capture` does nothing)."""
        return self.keys.n_active

    # -- admission -------------------------------------------------------------------------

    def write(self, key: int, trace_id: str | None, temperature: float, outputs: list[int]) -> bool:
        """Write the columns of a request captured under ``trace_id`` (None: not captured) at
        ``key``: its request ``temperature`` and its live ``outputs`` list (V1: its length is
        the generation step). False, writing nothing, when it is not captured (no trace id or
        no reporter); the caller then frees the key."""
        if trace_id is None or self.reporter is None:
            return False
        self._temperature[key] = temperature if self.logits_scaled else 1.0
        self._trace_ids[key] = trace_id
        self._outputs[key] = outputs
        return True

    def admit(self, key: int, trace_id: str | None, temperature: float, outputs: list[int]) -> bool:
        """Give ``key`` to a new request (`write`, then the key is live or freed); True when it
        is captured."""
        if self.write(key, trace_id, temperature, outputs):
            self.keys.activate(key)
            return True
        self.keys.free(key)
        return False

    # -- per step --------------------------------------------------------------------------

    def capture(
        self,
        logits: torch.Tensor,
        keys: np.ndarray,
        steps: np.ndarray | None = None,
    ) -> None:
        """Stage the rows of this step's captured requests (``logits`` ``[R, V]`` float32, not
        modified). ``keys``: the key of each row (host); ``steps``: the generation step of each
        row (host; -1 for a row whose sample vLLM discards), None for V1, where it is the
        length of the request's live output list. Never raises."""
        if not self.keys.n_active or self.reporter is None:
            return
        try:
            self._capture(logits, keys, steps)
        except Exception:  # capture must never reach serving
            _LOGGER.exception("noisy-temp-server: capturing served logits failed")

    def _capture(self, logits: torch.Tensor, keys: np.ndarray, steps: np.ndarray | None) -> None:
        assert self.reporter is not None
        if len(keys) != logits.shape[0]:  # V2 speculative decoding: several rows per request
            lost = int(self.keys.active[keys].sum())
            if lost:
                self.dropped["speculative"] += lost
                empty = logits[:0]
                self.reporter.stage_capture(CapturedStep([], [], empty, [], dict(self.dropped)))
            return
        rows = np.flatnonzero(self.keys.active[keys])
        if not rows.size:
            return
        row_keys = keys[rows]
        if steps is None:
            row_steps = np.fromiter(
                (len(self._outputs[key]) for key in row_keys.tolist()), np.int64, len(rows)
            )
        else:
            row_steps = steps[rows]
        wanted = (row_steps >= 0) & (row_steps < self.bounds.positions)
        rows, row_keys, row_steps = rows[wanted], row_keys[wanted], row_steps[wanted]
        if not rows.size:
            return
        order = (np.arange(rows.size) + self._turn) % rows.size  # rotated by the turn
        self._turn += 1
        limit = min(self.bounds.rows_per_step, self.reporter.capture_room())
        taken, left = order[:limit], order[limit:]
        over_bound = max(rows.size - self.bounds.rows_per_step, 0)
        self.dropped["rows_per_step"] += over_bound
        trace_ids = self._trace_ids
        dropped = [
            (trace_ids[key], step)
            for key, step in zip(row_keys[left].tolist(), row_steps[left].tolist(), strict=True)
        ]
        served = logits[:0]  # the queue is full: nothing to gather
        if taken.size:
            served = logits.index_select(0, self._upload_rows(rows[taken], logits.device))
        if self.logits_scaled and taken.size:
            scale = self._upload(self._temperature[row_keys[taken]], logits.device)
            served.mul_(scale.unsqueeze(1))
        self.reporter.stage_capture(
            CapturedStep(
                trace_ids=[trace_ids[key] for key in row_keys[taken].tolist()],
                steps=row_steps[taken].tolist(),
                rows=served,
                dropped=dropped,
                drop_counts=dict(self.dropped),
                queue_full=left.size - over_bound,
            )
        )

    def _upload(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        return upload(torch.from_numpy(array), device, pin=self._pin)

    def _upload_rows(self, rows: np.ndarray, device: torch.device) -> torch.Tensor:
        """The taken rows' indices on ``device``: on CUDA from pinned slots allocated once
        (`PinnedUploads`), else (or while those are all in flight) as any upload."""
        if self._pin:
            if self._row_uploads is None:
                self._row_uploads = PinnedUploads(16, self.bounds.rows_per_step, device)
            uploaded = self._row_uploads.upload(rows)
            if uploaded is not None:
                return uploaded
        return self._upload(rows, device)
