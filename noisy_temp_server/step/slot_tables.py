"""Per-slot tuning tables on the device, and how admission writes them: the half of
`slot_tuning.SlotTuning` that runs when requests arrive, never per step.

A *slot* is a request's place in a fixed-size table of ``capacity + 1`` entries (Model Runner
V2: vLLM's persistent request slot; V1 runner: a slot the V1 adapter assigns at admission, so
batch moves never touch the device). The last entry is a sentinel that is never tuned (the V1
adapter maps untuned rows there).

Admission evaluates the request's policy once (`policy.step_temperatures`, the torch-only
core): each slot gets its step-bucket edges and its T* per bucket (bounds folded in), plus the
schedule's ``beta`` and bounds. The edges of all slots live in one sorted key array (slot ``s``,
edge ``e`` -> ``s * STEP_STRIDE + e``), so one ``bucketize`` of a step's keys gives each row its
*cell* (slot, step bucket) and one gather its row of the cell table (T* or the schedule's scale,
``beta``, ``t_min``, ``t_max``). A cell whose T* is constant (every step-only rule but
``schedule``) gets its extrema at admission, so the step loop never touches them.

Admission (`SlotTables.stage`) only writes host-side staging lists; `SlotTables.flush_staged`
copies them to the device in one go (V2: ``apply_staged_writes``; V1: the end of
``update_state``).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from noisy_temp_server.devices import upload
from noisy_temp_server.engine_contract.request_args import LogitCorrection, RequestTuning
from noisy_temp_server.step.engine_metrics import MAX_LABELS, OVERFLOW_STEP_BUCKET
from noisy_temp_server.step.logit_bias import FILE_CORRECTIONS, CorrectionSource, SlotBias
from noisy_temp_server.step.reports import Occupancy, Reporter, StateLayout
from noisy_temp_server.step.row_reads import RowReads, cell_values, reading_edges
from noisy_temp_server.temperature.policy import TemperaturePolicy, step_bucket_labels
from noisy_temp_server.temperature.policy_eval import (
    StepTemperatures,
    step_temperatures,
)
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.temperature.stats import RowScratch

if TYPE_CHECKING:
    from noisy_temp_server.step.fused_step import FusedStep

__all__ = ["STEP_STRIDE", "SlotTables"]

STEP_STRIDE = 1 << 32
"""Slot stride of the step keys; generation steps stay below it."""
_PAD_EDGE = STEP_STRIDE - 1  # fills a slot's unused buckets: no step reaches it
_INITIAL_COLUMNS = 8
_UNTUNED_TABLE = StepTemperatures(step_edges=(0,), scale=(1.0,), beta=0.0, t_min=1.0, t_max=1.0)
_NO_POLICY = -1
_LOGGER = logging.getLogger(__name__)


@dataclass
class _RowPolicy:
    """A live policy that reads the served row, and how many slots use it."""

    policy_id: int
    policy: TemperaturePolicy
    slots: int = 0


_ADMITTED_SIZE = 1024
_admitted_tables: dict[tuple[object, ...], StepTemperatures | None] = {}


def _admitted(resolved: RequestTuning, request_temperature: float) -> StepTemperatures | None:
    """`step_temperatures` of a request, cached on all it depends on: the policy, the request's
    fixed T and bounds and, for ``calibrated``, the request-temperature band (found as
    `policy_temperature` finds it, in float32). At most `_ADMITTED_SIZE` entries (then it
    starts afresh)."""
    policy = resolved.policy
    band = 0
    if policy.rule is Rule.CALIBRATED:
        edges = np.asarray(policy.calibrated.request_temperature_edges, dtype=np.float32)
        band = int(np.searchsorted(edges, np.float32(request_temperature), side="right"))
    key = (policy, resolved.fixed_t, resolved.t_min, resolved.t_max, max(band - 1, 0))
    if key not in _admitted_tables:
        if len(_admitted_tables) >= _ADMITTED_SIZE:
            _admitted_tables.clear()
        _admitted_tables[key] = step_temperatures(
            policy,
            request_temperature,
            fixed=resolved.fixed_t,
            t_min=resolved.t_min,
            t_max=resolved.t_max,
        )
    return _admitted_tables[key]


class SlotTables:
    """The device-side tuning tables of one processor and their admission (see the module
    docstring); `slot_tuning.SlotTuning` adds the per-step work.

    ``logits_scaled``: whether ``tune`` sees logits already divided by the request temperature
    (V1 runner) or the unscaled served logits z̃ (V2). ``reporter``: None on ranks that do not
    report (tensor parallelism: only the first rank does), else where traces and summaries go.
    ``keep_last``: remember the last row of slots that `tune` is told to (``remember``) so
    `commit_last` can count it later (the V1 runner learns only a step late which row was a
    request's first token). ``vocab_size``: the logits' width, for the per-token bias
    (`logit_bias.SlotBias`; None: every bias is refused); ``corrections``: where its vectors
    come from (the bias directories unless told). ``fused_step``: run a step as Triton kernels
    (`fused_step`; the V1 runner's ``remember`` excepted): None on CUDA when Triton imports,
    True always (ImportError without Triton), False never.
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        *,
        logits_scaled: bool,
        reporter: Reporter | None,
        pin_memory: bool = False,
        keep_last: bool = False,
        vocab_size: int | None = None,
        corrections: CorrectionSource = FILE_CORRECTIONS,
        fused_step: bool | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.sentinel = capacity
        self.device = torch.device(device)
        self.logits_scaled = logits_scaled
        self.reporter = reporter
        self._pin = pin_memory
        n = capacity + 1
        # Host mirrors of the per-slot tables, written at admission only.
        self._edges = np.full((n, _INITIAL_COLUMNS), _PAD_EDGE, dtype=np.int64)
        self._edges[:, 0] = 0
        self._scale = np.ones((n, _INITIAL_COLUMNS), dtype=np.float32)
        self._labels = np.full((n, _INITIAL_COLUMNS), -1, dtype=np.int64)
        # Per slot: schedule beta, t_min, t_max (copied into each of its cells).
        self._schedule = np.asarray([(0.0, 1.0, 1.0)] * n, dtype=np.float32)
        self.request_temperature = torch.ones(n, device=self.device)
        self.policy_id = torch.full((n,), _NO_POLICY, dtype=torch.int64, device=self.device)
        self.traced = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.tuned = torch.zeros(n, dtype=torch.bool, device=self.device)
        # accumulate(): the rows' (1, T, -T, T) = unit + signs * T, as [4, R] in one op.
        self._unit = torch.tensor([[1.0], [0.0], [0.0], [0.0]], dtype=torch.float64).to(device)
        self._signs = torch.tensor([[0.0], [1.0], [-1.0], [1.0]], dtype=torch.float64).to(device)
        self.last = (
            torch.zeros(n, 3, dtype=torch.float64, device=self.device) if keep_last else None
        )
        self.host_policy_id = np.full(n, _NO_POLICY, dtype=np.int64)
        self.occupants: list[tuple[str | None, int]] = [(None, 0)] * n
        self._serial = 0
        self.n_traced = 0
        self._host_traced = np.zeros(n, dtype=bool)
        self.host_tuned = np.zeros(n, dtype=bool)  # as `tuned` will be after the next flush
        self._n_scheduled = 0
        self._host_scheduled = np.zeros(n, dtype=bool)
        self._row_policies: dict[int, _RowPolicy] = {}
        # Slots whose policy reads the served row at a request temperature other than 1.
        self.n_rescaled = 0
        self._host_rescaled = np.zeros(n, dtype=bool)
        self._row_policy_ids: dict[TemperaturePolicy, int] = {}
        self._label_ids: dict[tuple[str, str], int] = {}
        self._staged: list[tuple[int, RequestTuning | None, float]] = []
        self._keep_before_flush = False
        self._build_tables(_INITIAL_COLUMNS)
        self.bias = SlotBias(n, vocab_size, self.device, pin_memory=pin_memory, source=corrections)
        self.row_reads = RowReads(n, self.upload)
        self.fused_step = _load_fused_step(fused_step, self.device)
        # The rules that read the served row: its rescaled copy, and the statistics' buffers.
        self.served_rows = RowScratch()
        self.feature_rows = RowScratch()

    def _build_tables(self, columns: int) -> None:
        """(Re)build the device tables for ``columns`` buckets per slot from the host mirrors,
        with a fresh accumulator state."""
        self.layout = StateLayout(slots=self.capacity + 1, columns=columns)
        slot_base = np.arange(self.capacity + 1, dtype=np.int64)[:, None] * STEP_STRIDE
        self.edge_keys = torch.from_numpy(slot_base + self._edges).view(-1).to(self.device)
        self.cell_table = torch.tensor([[1.0, 0.0, 1.0, 1.0]], device=self.device).repeat(
            self.layout.cells, 1
        )
        self.cell_table[1:] = torch.from_numpy(self._cell_rows(np.arange(self.capacity + 1)))
        self.cell_unit = _count_and_value(self.cell_table[:, 0])
        self.state = self.layout.initial(self.device)
        self.accumulators, self.extrema, self.bad_rows = self.layout.split(self.state)
        self.extrema[:, 1:] = self.upload(self._initial_extrema(np.arange(self.capacity + 1)))

    def _cell_rows(self, slots: np.ndarray) -> np.ndarray:
        """``[len(slots) * columns, 4]`` rows of the slots' cells in `cell_table`: (T* or the
        schedule's scale, the slot's schedule beta, t_min, t_max)."""
        columns = self.layout.columns
        rows = np.empty((len(slots), columns, 4), dtype=np.float32)
        rows[..., 0] = self._scale[slots]
        rows[..., 1:] = self._schedule[slots, None, :]
        return rows.reshape(-1, 4)

    def _initial_extrema(self, slots: np.ndarray) -> np.ndarray:
        """``[2, len(slots) * columns]`` extrema the slots' cells start from: (-T*, T*) of a
        cell whose T* is constant (the step-only rules but ``schedule``; the step loop then
        never touches them), -inf where T* varies within the cell."""
        varying = self._host_scheduled[slots] | (self.host_policy_id[slots] != _NO_POLICY)
        scale = self._scale[slots].astype(np.float64)
        extrema = np.stack((-scale, scale))
        extrema[:, varying] = -np.inf
        return extrema.reshape(2, -1)

    # -- admission -------------------------------------------------------------------------

    def stage(
        self,
        slot: int,
        resolved: RequestTuning | None,
        request_temperature: float,
        correction: LogitCorrection | None = None,
    ) -> None:
        """Give ``slot`` to a new occupant (``resolved``; None: untuned; ``correction``: its
        per-token bias) from the next `flush_staged` on; the previous occupant's
        state is dropped (after one last report)."""
        self._release(slot)
        self.bias.stage(slot, correction)
        if resolved is not None:
            self._serial += 1
            self.occupants[slot] = (resolved.trace_id, self._serial)
            traced = resolved.trace and resolved.trace_id is not None
            self._host_traced[slot] = traced
            self.host_tuned[slot] = True
            self.n_traced += traced
        self._staged.append((slot, resolved, request_temperature))

    def _release(self, slot: int) -> None:
        if self.occupants[slot] != (None, 0):
            self._keep_before_flush = True
        policy_id = int(self.host_policy_id[slot])
        if policy_id != _NO_POLICY:
            entry = self._row_policies[policy_id]
            entry.slots -= 1
            if entry.slots == 0:
                del self._row_policies[policy_id]
                del self._row_policy_ids[entry.policy]
        self.host_policy_id[slot] = _NO_POLICY
        self.occupants[slot] = (None, 0)
        self.n_traced -= bool(self._host_traced[slot])
        self._host_traced[slot] = False
        self.host_tuned[slot] = False
        self._n_scheduled -= bool(self._host_scheduled[slot])
        self._host_scheduled[slot] = False
        self.n_rescaled -= bool(self._host_rescaled[slot])
        self._host_rescaled[slot] = False

    def _row_policy(self, policy: TemperaturePolicy) -> _RowPolicy:
        policy_id = self._row_policy_ids.get(policy)
        if policy_id is None:
            policy_id = next(
                i for i in range(len(self._row_policies) + 1) if i not in self._row_policies
            )
            self._row_policies[policy_id] = _RowPolicy(policy_id, policy)
            self._row_policy_ids[policy] = policy_id
        return self._row_policies[policy_id]

    def _label(self, step_label: str, rule: Rule) -> int:
        """The histogram label id of (step bucket, rule); past `MAX_LABELS` pairs, the rule's
        shared overflow pair (at most `MAX_LABELS` + one per rule ids in all)."""
        key = (step_label, rule.value)
        if key not in self._label_ids and len(self._label_ids) >= MAX_LABELS:
            key = (OVERFLOW_STEP_BUCKET, rule.value)
        label = self._label_ids.get(key)
        if label is None:
            label = self._label_ids[key] = len(self._label_ids)
            if self.reporter is not None:
                self.reporter.name_label(label, key)
        return label

    def _slot_table(
        self, slot: int, resolved: RequestTuning | None, request_temperature: float
    ) -> tuple[StepTemperatures, list[int]]:
        """The slot's step table and the histogram label of each of its step buckets."""
        table = None if resolved is None else _admitted(resolved, request_temperature)
        self.row_reads.assign(slot, None if resolved is None or table else resolved.policy)
        if resolved is None:
            return _UNTUNED_TABLE, [-1]
        policy = resolved.policy
        if table is None:  # reads the served row: per step (`row_reads`; the torch path:
            entry = self._row_policy(policy)  # `policy_temperature`)
            entry.slots += 1
            self.host_policy_id[slot] = entry.policy_id
            edges = reading_edges(policy)
            self._host_rescaled[slot] = request_temperature != 1.0
            self.n_rescaled += request_temperature != 1.0
            table = replace(
                _UNTUNED_TABLE,
                step_edges=edges,
                scale=cell_values(policy, edges, request_temperature),
                t_min=resolved.t_min,
                t_max=resolved.t_max,
            )
        names = step_bucket_labels(policy.step_edges)
        labels = [
            self._label(names[bisect.bisect_right(policy.step_edges, edge) - 1], policy.rule)
            for edge in table.step_edges
        ]
        self._host_scheduled[slot] = table.beta > 0
        self._n_scheduled += table.beta > 0
        return table, labels

    def flush_staged(self) -> None:
        """Write the staged admissions to the device: one host→device copy per table."""
        self.bias.flush()
        if not self._staged:
            return
        self._flush_tables()
        self.row_reads.flush()

    def _flush_tables(self) -> None:
        """`flush_staged` of the slot tables: the staged slots' tables, resized to the widest."""
        latest = {slot: (resolved, temperature) for slot, resolved, temperature in self._staged}
        self._staged.clear()
        slots = list(latest)
        request_temperatures, tables = [], {}
        for slot in slots:
            resolved, temperature = latest[slot]
            tables[slot] = self._slot_table(slot, resolved, temperature)
            table = tables[slot][0]
            request_temperatures.append(temperature if resolved else 1.0)
        widths = (self._edges != _PAD_EDGE).sum(axis=1)
        for slot, (table, _) in tables.items():
            widths[slot] = len(table.step_edges)
        needed, columns = int(widths.max()), self.layout.columns
        if needed > columns:
            self._resize(max(needed, 2 * columns))
        elif columns > _INITIAL_COLUMNS and 4 * needed <= columns:
            self._resize(max(_INITIAL_COLUMNS, 2 * needed))
        elif self._keep_before_flush and self.reporter is not None:
            self.reporter.stage_snapshot(self.state, self.layout, keep=True)
        self._keep_before_flush = False
        for slot, (table, labels) in tables.items():
            width = len(table.step_edges)
            self._edges[slot] = _PAD_EDGE
            self._edges[slot, :width] = table.step_edges
            self._scale[slot] = 1.0
            self._scale[slot, :width] = table.scale
            self._labels[slot] = -1
            self._labels[slot, :width] = labels
            self._schedule[slot] = (table.beta, table.t_min, table.t_max)
        self._upload_slots(slots)
        index = self.upload(np.asarray(slots, dtype=np.int64))
        temperatures = np.asarray(request_temperatures, dtype=np.float32)
        self.request_temperature.index_copy_(0, index, self.upload(temperatures))
        self.policy_id.index_copy_(0, index, self.upload(self.host_policy_id[slots]))
        self.traced.index_copy_(0, index, self.upload(self._host_traced[slots]))
        tuned = np.asarray([latest[slot][0] is not None for slot in slots])
        self.tuned.index_copy_(0, index, self.upload(tuned))
        if self.reporter is not None:
            self.reporter.set_occupancy(Occupancy(tuple(self.occupants), self._labels.copy()))

    def _upload_slots(self, slots: list[int]) -> None:
        """Copy the slots' rows of the host tables to the device and reset their cells."""
        columns = self.layout.columns
        rows = np.asarray(slots, dtype=np.int64)
        keys = rows[:, None] * STEP_STRIDE + self._edges[rows]
        cells = 1 + rows[:, None] * columns + np.arange(columns)
        keys_index = self.upload((cells - 1).reshape(-1))
        self.edge_keys.index_copy_(0, keys_index, self.upload(keys.reshape(-1)))
        cells_index = self.upload(cells.reshape(-1))
        cell_rows = self.upload(self._cell_rows(rows))
        self.cell_table.index_copy_(0, cells_index, cell_rows)
        self.cell_unit.index_copy_(1, cells_index, _count_and_value(cell_rows[:, 0]))
        self.accumulators.index_fill_(1, cells_index, 0.0)
        self.extrema.index_copy_(1, cells_index, self.upload(self._initial_extrema(rows)))

    def _resize(self, columns: int) -> None:
        """Rebuild the tables with ``columns`` step buckets per slot: more when a wider policy
        arrives (doubling), fewer once no slot needs a quarter of them (halving at least), so
        the state copied to the host each step (4 float64 per bucket and slot; at most 128
        buckets: `MAX_STEP_EDGES` policy edges merged with as many calibrated ones) follows
        the widest table still in a slot. The accumulated state starts afresh after a kept
        report, as a new occupancy of every tuned slot (the trace collector merges a request's
        occupancies); the bad-row count carries over (it never goes backwards)."""
        if self.reporter is not None:
            self.reporter.stage_snapshot(self.state, self.layout, keep=True)
        bad_rows = self.bad_rows
        pad = columns - self.layout.columns
        if pad > 0:
            self._edges = np.pad(self._edges, ((0, 0), (0, pad)), constant_values=_PAD_EDGE)
            self._scale = np.pad(self._scale, ((0, 0), (0, pad)), constant_values=1.0)
            self._labels = np.pad(self._labels, ((0, 0), (0, pad)), constant_values=-1)
        else:
            self._edges = self._edges[:, :columns].copy()
            self._scale = self._scale[:, :columns].copy()
            self._labels = self._labels[:, :columns].copy()
        self._build_tables(columns)
        self.bad_rows.copy_(bad_rows)
        for slot, (trace_id, serial) in enumerate(self.occupants):
            if serial:
                self._serial += 1
                self.occupants[slot] = (trace_id, self._serial)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device (asynchronously, from pinned memory on CUDA)."""
        return upload(torch.from_numpy(np.ascontiguousarray(array)), self.device, pin=self._pin)

    def summaries(self) -> np.ndarray:
        """``[slots, 4]`` (sum, count, min, max) of each slot's counted T* so far (a device
        sync: for tests and diagnostics, never called per step)."""
        return self.layout.summaries(self.state.cpu().numpy())

    # -- per step --------------------------------------------------------------------------


def _count_and_value(temperature: torch.Tensor) -> torch.Tensor:
    """``[2, N]`` float64 (1, T*) columns: what one row adds to a cell's (count, sum)."""
    return torch.stack((torch.ones_like(temperature), temperature)).double()


def _load_fused_step(wanted: bool | None, device: torch.device) -> FusedStep | None:
    """A `fused_step.FusedStep` where the step uses it: ``wanted`` True (Triton must import),
    None (on CUDA when Triton imports) or False (never)."""
    if wanted is False or (wanted is None and device.type != "cuda"):
        return None
    try:
        from noisy_temp_server.step.fused_step import FusedStep  # noqa: PLC0415
    except ImportError:
        if wanted:
            raise
        _LOGGER.warning("Triton does not import: the T* step runs as separate torch operations")
        return None
    return FusedStep(device)
