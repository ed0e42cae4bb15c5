"""Per-slot tuning on the device, per step: the part of the T* processor both vLLM runners
share (the tables and their admission: `slot_tables.SlotTables`).

Per step, the runner adapter hands `SlotTuning.tune` the logits rows, the slot of each row and
its *step key* ``slot * STEP_STRIDE + generation step`` (all device tensors); everything else
happens on the device. One ``bucketize`` of the step keys gives each row its *cell* (slot, step
bucket) and one gather its row of the cell table. A step of the step-only rules (off, fixed,
sqrt, linear, schedule, a step-only calibrated table) is therefore:

    bucketize + gather (+ the schedule's factor and clamp) + one division + accounting

(on CUDA, for every rule, Triton kernels that do the same in one launch: `fused_step`), with
no check of the logits: T* is finite and > 0 by construction, and
dividing a row by it never makes a finite logit non-finite nor changes which logits are NaN or
±inf, so a *bad row* (NaN or +inf logits, or all masked) reaches vLLM's sampler exactly as it
would without the processor. Rules that read the served row (``fisher``, an entropy-dependent
``calibrated`` table) run `policy_temperature` once per live policy over the batch; a bad row
has NaN statistics there and gets T* = 1.

Accounting adds the count and sum of T* per cell (one ``index_add_``; rows the engine discards
go to cell 0). A cell whose T* is constant (every step-only rule but ``schedule``) gets its
extrema at admission and its (1, T*) row from the cell table, so a batch of such rows costs a
gather and that ``index_add_``; while some slot's T* varies within a cell (``schedule``, rules
that read the served row) the step builds the rows' ``(1, T, -T, T)`` (one ``addcmul``), adds
``(1, T)`` and takes the extrema with one ``scatter_reduce_`` over ``(-T, T)``. Bad rows of
tuned requests, whatever the rule, are counted in ``bad_rows`` by one reduction over the logits
(a row is bad when its max is not finite). `reports.Reporter` reads
an asynchronous copy of that state and reduces it on the host into per-request summaries and
the ``nts_step_temperature`` histogram. The per-step trace is copied only while some slot is
traced.

``fisher`` with a request temperature T_req ≠ 1 takes the variance under the distribution being
corrected, softmax(z̃ / T_req) (kl-optimal-temperature-derivation.md with z/T_req as the clean
logits and noise σ²/T_req²): T* = 1 + σ² / Var_{softmax(z̃/T_req)}(z̃). The calibrated table's
entropy is read from the served row z̃, as in calibration.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from noisy_temp_server.step.slot_tables import STEP_STRIDE, SlotTables
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.temperature.stats import ServedRowFeatures, served_row_features

__all__ = ["STEP_STRIDE", "SlotTuning"]

_STEP_MASK = STEP_STRIDE - 1  # a step key's step


class SlotTuning(SlotTables):
    """The device-side tuning table of one processor: `SlotTables` (construction, admission)
    and the per-step work (see the module docstring)."""

    def tune(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        counted: torch.Tensor | None,
        *,
        remember: bool = False,
        all_rows_tuned: bool = False,
        batch_slots: np.ndarray | None = None,
    ) -> None:
        """Add each row's per-token bias (if its slot has one), divide
        the row by its T* (``logits``: [R, V] float32, in place) and account it.

        ``slots``/``keys``: [R] integer slot (int32 or int64) and int64 step key of each row,
        ``slot * STEP_STRIDE + generation step``. ``counted``: [R] bool (or 0/1 integers), rows
        whose sample the engine keeps (they enter the summaries and the histogram); None: all.
        ``remember``: keep each row's T* for `commit_last` (needs ``keep_last``).
        ``all_rows_tuned``: the caller knows every row's slot holds a tuned request (the
        bad-row count then skips the gather of the slots' tuned flags). ``batch_slots``: the
        batch's slots on the host, when a slot outside the batch may still hold a bias
        (`logit_bias.SlotBias.add`: only the versions of these slots are added). T* is 1 for
        untuned rows and for bad rows of rules that read the served row; a bad row of a
        step-only rule keeps its T*. No host sync.
        """
        if self._fuses(remember=remember) and self._fused_tune(
            logits, slots, keys, counted, all_rows_tuned=all_rows_tuned
        ):
            return
        self.bias.add(logits, slots, batch_slots)
        cells = torch.bucketize(keys, self.edge_keys, right=True)
        cell = self.cell_table.index_select(0, cells)
        steps = varying = None
        # Bad rows (NaN, +inf, all -inf): read before the division, which may overflow.
        peak = None if self.reporter is None else logits.amax(1)
        if self._n_scheduled or self._row_policies:  # [R] T* of each row, then as a column
            temperature, beta, t_min, t_max = cell.unbind(1)
            steps = keys & _STEP_MASK
            if self._n_scheduled:  # as `rules.schedule_temperature`, bit for bit
                factor = beta.mul(steps).add_(1.0).rsqrt_()
                temperature = factor.mul_(temperature).clamp_(t_min, t_max)
            if self._row_policies:
                temperature = self._read_rows(
                    logits,
                    slots,
                    steps,
                    temperature=temperature,
                    t_min=t_min,
                    t_max=t_max,
                )
            varying, column = temperature, temperature.unsqueeze(1)
        else:  # T* of every row is its cell's: the table's column
            column = cell[:, :1]
        logits.div_(column)
        if peak is not None:
            self._account(
                cells,
                slots,
                keys,
                steps=steps,
                column=column,
                counted=counted,
                peak=peak,
                varying=varying,
                remember=remember,
                all_rows_tuned=all_rows_tuned,
            )

    def _fuses(self, *, remember: bool) -> bool:
        """Whether this step may run as the fused kernels: they are loaded and nothing is
        remembered (the V1 runner's ``remember`` keeps the torch path)."""
        return self.fused_step is not None and not remember

    def _fused_tune(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        counted: torch.Tensor | None,
        *,
        all_rows_tuned: bool,
    ) -> bool:
        """`tune` in the fused kernels (`fused_step`), then the reports; False, having done
        nothing, where the kernels do not take the tensors."""
        assert self.fused_step is not None
        reporter = self.reporter
        trace = self.fused_step(
            logits,
            slots,
            keys,
            counted,
            tables=self._step_tables(),
            bias_rows=self.bias.slot_rows if self.bias.biased_slots else None,
            tuned=None if all_rows_tuned else self.tuned,
            accounts=None if reporter is None else (self.accumulators, self.extrema, self.bad_rows),
            traced=self.traced if self.n_traced and reporter is not None else None,
            schedule=bool(self._n_scheduled),
            reading=bool(self._row_policies),
            logits_scaled=self.logits_scaled,
        )
        if trace is not None and reporter is not None:
            if self.n_traced:  # the kernel wrote the trace's rows
                reporter.stage_trace(trace)
            reporter.stage_snapshot(self.state, self.layout)
        return trace is not None

    def _step_tables(self) -> dict[str, torch.Tensor]:
        """The tables the fused step reads (`fused_step.FusedStep`)."""
        return {
            "edge_keys": self.edge_keys,
            "cell_table": self.cell_table,
            "bias_table": self.bias.table,
            "reads": self.row_reads.table,
            "read_values": self.row_reads.values,
            "request_temperature": self.request_temperature,
        }

    def warm_up(self, vocab: int, counted: torch.dtype | None) -> None:
        """On CUDA, compile the fused kernels' variants this processor runs (logits ``vocab``
        wide, int64 slots and step keys, counted rows of dtype ``counted`` or None), so that no
        request's first step pays for it; nothing elsewhere, or without the fused step. The
        reporter's host memory is allocated too (`Reporter.prepare`)."""
        if self.reporter is not None:
            self.reporter.prepare(vocab, self.device)
        if self.fused_step is not None and self.device.type == "cuda":
            self.fused_step.warm_up(
                vocab,
                counted=counted,
                accounting=self.reporter is not None,
                logits_scaled=self.logits_scaled,
            )

    def _read_rows(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        steps: torch.Tensor,
        *,
        temperature: torch.Tensor,
        t_min: torch.Tensor,
        t_max: torch.Tensor,
    ) -> torch.Tensor:
        """T* of the rows whose policy reads the served row (one `policy_temperature` per live
        such policy; a bad row has NaN statistics and gets T* = 1)."""
        policy_of_row = self.policy_id.index_select(0, slots)
        request_temperature = self.request_temperature.index_select(0, slots)
        features: dict[Rule, ServedRowFeatures] = {}
        for entry in self._row_policies.values():
            served = self._features(entry.policy, logits, request_temperature, features)
            value = policy_temperature(
                entry.policy,
                steps,
                served_features=served,
                t_min=t_min,
                t_max=t_max,
                request_temperature=request_temperature,
                validate=False,
            )
            mine = policy_of_row == entry.policy_id
            temperature = torch.where(mine, value, temperature)
        return temperature

    def _features(
        self,
        policy: TemperaturePolicy,
        logits: torch.Tensor,
        request_temperature: torch.Tensor,
        cache: dict[Rule, ServedRowFeatures],
    ) -> ServedRowFeatures:
        """The served-row features ``policy`` reads, computed once per step and rule over the
        whole batch. The rows are rescaled by their request temperature only while some slot
        that reads the served row has one other than 1 (`n_rescaled`)."""
        rule = policy.rule
        if rule not in cache:
            scale = request_temperature.unsqueeze(1)
            rescale = self.n_rescaled > 0
            if rule is Rule.FISHER:
                # Var under softmax(z~ / T_req), in units of z~.
                divide = rescale and not self.logits_scaled
                corrected = self._rescaled(logits, scale, divide=True) if divide else logits
                found = served_row_features(corrected, validate=False, scratch=self.feature_rows)
                cache[rule] = replace(found, var_q=found.var_q * request_temperature.square())
            else:
                multiply = rescale and self.logits_scaled
                served = self._rescaled(logits, scale, divide=False) if multiply else logits
                cache[rule] = served_row_features(
                    served, validate=False, need_variance=False, scratch=self.feature_rows
                )
        return cache[rule]

    def _rescaled(self, logits: torch.Tensor, scale: torch.Tensor, *, divide: bool) -> torch.Tensor:
        """``logits / scale`` (``divide``) or ``logits * scale``, in the reused buffer
        `served_rows` (overwritten by the next call)."""
        (copy,) = self.served_rows.take(1, logits, logits.dtype)
        operation = torch.div if divide else torch.mul
        return operation(logits, scale, out=copy)

    def _account(
        self,
        cells: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        *,
        steps: torch.Tensor | None,
        column: torch.Tensor,
        counted: torch.Tensor | None,
        peak: torch.Tensor,
        varying: torch.Tensor | None,
        remember: bool,
        all_rows_tuned: bool,
    ) -> None:
        """Summaries and histogram cells (``column``: [R, 1] T* of each row; ``steps``: each
        row's step, if the caller computed it from ``keys``), bad rows
        (``peak``: each row's max logit before the division), the step's trace (when some slot
        is traced), and the rows `commit_last` may count later. ``varying``: [R] T* when some
        T* is not its cell's constant; None: the count and sum come from the cell table in one
        op and the extrema are the ones preset at admission."""
        assert self.reporter is not None
        if remember and self.last is not None:
            bucket = cells - 1 - slots * self.layout.columns
            value = column.squeeze(1).double()
            flag = torch.ones_like(value) if counted is None else counted.double()
            last = torch.stack((bucket.double(), value, flag), dim=1)
            self.last.index_copy_(0, slots, last)
        if counted is not None:
            cells = cells.mul_(counted)  # rows not counted go to cell 0
        if varying is not None:
            self.accumulate(cells, varying)
        else:
            self.accumulators.index_add_(1, cells, self.cell_unit.index_select(1, cells))
        not_finite = peak.sub_(peak).isnan()  # inf - inf and NaN - NaN are NaN
        if not all_rows_tuned:
            not_finite.logical_and_(self.tuned.index_select(0, slots))
        self.bad_rows.add_(torch.count_nonzero(not_finite))
        self._stage_reports(slots, keys, steps, column.squeeze(1))

    def _stage_reports(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        steps: torch.Tensor | None,
        temperature: torch.Tensor,
    ) -> None:
        """The step's trace (while some slot is traced; ``temperature``: [R] T* of each row,
        ``steps``: each row's step if computed from ``keys``), then the state's snapshot."""
        assert self.reporter is not None
        if self.n_traced:
            if steps is None:
                steps = keys & _STEP_MASK
            dtype = temperature.dtype
            rows = (
                slots.to(dtype),
                steps.to(dtype),
                temperature,
                self.traced.index_select(0, slots).to(dtype),
            )
            self.reporter.stage_trace(torch.stack(rows))
        self.reporter.stage_snapshot(self.state, self.layout)

    def commit_last(self, slots: torch.Tensor) -> None:
        """Count the last remembered row of each of ``slots`` if it was not counted (needs
        ``keep_last``). Call before the slots' next `tune`."""
        if self.last is None or self.reporter is None:
            return
        column, temperature, counted = self.last.index_select(0, slots).unbind(1)
        cells = 1 + slots * self.layout.columns + column.long()
        self.accumulate(cells * (counted == 0), temperature)
        self.reporter.stage_snapshot(self.state, self.layout)

    def accumulate(self, cells: torch.Tensor, temperature: torch.Tensor) -> None:
        """Add one row per entry of ``cells`` (cell 0: not counted) with its T*
        (``temperature``: [R]) to the count, sum and extrema of its cell. Three device ops: the
        rows' (1, T, -T, T) in float64 (exact for a finite float32 T), one ``index_add_`` and
        one ``scatter_reduce_``."""
        rows = torch.addcmul(self._unit, self._signs, temperature)
        self.accumulators.index_add_(1, cells, rows[:2])
        self.extrema.scatter_reduce_(1, cells.expand(2, -1), rows[2:], "amax")
