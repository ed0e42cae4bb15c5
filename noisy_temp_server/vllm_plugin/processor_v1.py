"""`NoisyTemperatureV1`: the T* processor under vLLM's V1 model runner (the CPU runner).

The V1 runner tells the processor how its persistent batch changed (`BatchUpdate`: removed →
added → moved). Each tuned request gets a slot of `SlotTuning` for its lifetime; batch rows map
to slots in a host array copied to the device only when the batch changed, so moves cost
nothing on the device and untuned rows map to the sentinel slot.

Steps are counted on the device: a slot's step starts at ``len(output_token_ids)`` when the
request is admitted and advances by one per ``apply`` once the request has produced a token
(while it is still prefilling, possibly over several chunked-prefill steps, its row is sampled
and discarded at that same step). The host looks at the live output lists only of requests that
have not produced their first token yet; when one has, the row of that token is counted
(`SlotTuning.commit_last`) and its step starts advancing.

Where V1 runs the processor depends on `is_argmax_invariant`, fixed at construction: an
argmax-invariant processor runs only for sampled rows, after penalties, the request temperature
and min-p (logits z̃/T_req); the others run for every row, greedy ones included, before
penalties and the request temperature (logits z̃). A per-token bias changes greedy output, so
when a bias is possible (the engine has a bias directory, `bias_files.bias_directories`) the
processor is not argmax-invariant: it sees z̃ as under Model Runner V2, adds b and divides by
T*, and the sampler's division by T_req gives softmax((z̃ + b)/(T_req·T*)), min-p included.
Frequency and presence penalties then act on (z̃ + b)/T* (on z̃ + b under V2, where they run
first). Without a bias directory it stays argmax-invariant, as vLLM prefers: greedy-only
batches skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from noisy_temp_server.devices import upload
from noisy_temp_server.engine_contract.bias_files import bias_directories
from noisy_temp_server.engine_contract.request_args import NOT_ADMITTED, AdmittedRequest
from noisy_temp_server.step.slot_tuning import STEP_STRIDE
from noisy_temp_server.vllm_plugin.processor_common import (
    TunedProcessor,
    admitted_request,
    build_slot_tuning,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["NoisyTemperatureV1"]


class NoisyTemperatureV1(TunedProcessor, LogitsProcessor):
    """Divides each tuned row's logits by its T* (already divided by T_request unless a bias
    is possible; then the per-token bias is added first, see the module docstring).

    ``first``: ``logits -> logits``, work that must come before ours when we run among the
    non-argmax-invariant processors (the runtime noise: vLLM runs entry-point processors, ours,
    before class-path ones, so the noise processor hands it over, see
    `runtime_noise.RuntimeNoiseV1`); `apply` runs it before the capture and T*."""

    first: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        is_pin_memory: bool,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """vLLM's V1 constructor; ValueError when ``NTS_POLICY_FILE`` is set but invalid."""
        capacity = vllm_config.scheduler_config.max_num_seqs
        self._vllm_config = vllm_config  # keeps id(vllm_config) unique while self lives
        self._argmax_invariant = not bias_directories()
        vocab_size = None if self._argmax_invariant else vllm_config.model_config.get_vocab_size()
        self.duplicate, self.tuning, self.capture = build_slot_tuning(
            self,
            vllm_config,
            capacity,
            device,
            logits_scaled=self._argmax_invariant,
            registry=registry,
            keep_last=True,
            vocab_size=vocab_size,
        )
        if not self.duplicate and self.tuning.device.type == "cuda":  # compile the fused step now
            self.tuning.warm_up(vllm_config.model_config.get_vocab_size(), torch.int64)
        self.device = self.tuning.device
        self._pin = is_pin_memory
        sentinel = self.tuning.sentinel
        self._row_slot = np.full(capacity, sentinel, dtype=np.int64)
        self._row_slot_device = self._upload(self._row_slot)
        self._free = list(range(capacity - 1, -1, -1))
        # Per slot: its step key ``slot * STEP_STRIDE + generation step``, and whether the step
        # advances (1) or waits (0).
        self._key_of_slot = torch.arange(capacity + 1, device=self.device) * STEP_STRIDE
        self._advancing = torch.zeros(capacity + 1, dtype=torch.int64, device=self.device)
        self._all_ones = torch.ones(capacity, dtype=torch.int64, device=self.device)
        # The batch's slots (the first rows of the row slots) and as many ones, sliced anew
        # when the batch size or the row slots change.
        self._slots, self._ones, self._slots_rows = self._row_slot_device, self._all_ones, 0
        self._waiting: dict[int, tuple[list[int], int]] = {}  # slot -> (outputs, len at entry)
        self._step_writes: dict[int, tuple[int, int]] = {}  # slot -> (step, advancing)
        self._n_tuned_rows = 0
        self._tuned_prefix = 0  # batch rows [0, this) all hold tuned requests
        self._batch_rows = np.arange(capacity)

    def is_argmax_invariant(self) -> bool:
        """A positive temperature never changes the argmax; a per-token bias does (False when
        the engine has a bias directory)."""
        return self._argmax_invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Apply the batch changes, start the steps of requests that produced their first token
        and copy what changed to the device."""
        admitted = self._admit_added(batch_update)
        self.capture.update(batch_update, [request.capture_trace_id for request in admitted])
        changed = batch_update is not None and self._update_rows(batch_update, admitted)
        started = [slot for slot, (outputs, entry) in self._waiting.items() if len(outputs) > entry]
        if started:
            self.tuning.commit_last(self._upload(np.asarray(started, dtype=np.int64)))
            for slot in started:
                outputs, _ = self._waiting.pop(slot)
                self._step_writes[slot] = (len(outputs), 1)
        self.tuning.flush_staged()
        self._flush_steps()
        if changed:
            self._row_slot_device = self._upload(self._row_slot)
            self._slots_rows = 0  # `apply` slices it anew
            self._n_tuned_rows = int((self._row_slot != self.tuning.sentinel).sum())
            untuned = ~self.tuning.host_tuned[self._row_slot]
            self._tuned_prefix = int(untuned.argmax()) if untuned.any() else len(untuned)

    def _admit_added(self, batch_update: BatchUpdate | None) -> list[AdmittedRequest]:
        """The requests ``batch_update`` adds, in its order, each read once (`admitted_request`;
        a duplicate does nothing with them)."""
        if batch_update is None:
            return []
        if self.duplicate:
            return [NOT_ADMITTED] * len(batch_update.added)
        return [admitted_request(params) for _row, params, _prompt, _out in batch_update.added]

    def _update_rows(self, batch_update: BatchUpdate, admitted: list[AdmittedRequest]) -> bool:
        for row in batch_update.removed:
            self._free_row(row)
        for (row, params, _prompt_ids, outputs), request in zip(
            batch_update.added, admitted, strict=True
        ):
            self._free_row(row)
            resolved, correction = request.tuning, request.correction
            if resolved is None and correction is None:
                continue
            slot = self._free.pop()
            self.tuning.stage(slot, resolved, params.temperature, correction)
            self._row_slot[row] = slot
            if resolved is not None:  # a bias-only slot (greedy) stays at step 0, uncounted
                self._waiting[slot] = (outputs, len(outputs))
            self._step_writes[slot] = (len(outputs), 0)
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self._row_slot[[a, b]] = self._row_slot[[b, a]]
            else:
                self._free_row(b)
                self._row_slot[b], self._row_slot[a] = self._row_slot[a], self.tuning.sentinel
        return True

    def _free_row(self, row: int) -> None:
        slot = int(self._row_slot[row])
        if slot == self.tuning.sentinel:
            return
        if self._waiting.pop(slot, None) is not None:
            # Finished (or preempted) before its first token was seen: its last row counts.
            self.tuning.commit_last(self._upload(np.asarray([slot], dtype=np.int64)))
        self.tuning.stage(slot, None, 1.0)
        self._step_writes.pop(slot, None)
        self._row_slot[row] = self.tuning.sentinel
        self._free.append(slot)

    def _flush_steps(self) -> None:
        if not self._step_writes:
            return
        slots = np.fromiter(self._step_writes, dtype=np.int64)
        steps, advancing = np.asarray(list(self._step_writes.values()), dtype=np.int64).T
        index = self._upload(slots)
        self._key_of_slot.index_copy_(0, index, self._upload(slots * STEP_STRIDE + steps))
        self._advancing.index_copy_(0, index, self._upload(advancing))
        self._step_writes.clear()

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return upload(torch.from_numpy(array.copy()), self.device, pin=self._pin)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] float32, biased and divided in place on the tuned rows and returned.
        Other rows are bitwise unchanged. Captured rows (`capture`) are taken first. No host
        sync."""
        if self.first is not None:
            logits = self.first(logits)
        rows = logits.shape[0]
        if self.capture.active:
            self.capture.capture(logits, self._batch_rows[:rows])
        if not self._n_tuned_rows:
            return logits
        if rows != self._slots_rows:
            self._slots, self._ones = self._row_slot_device[:rows], self._all_ones[:rows]
            self._slots_rows = rows
        slots = self._slots
        keys = self._key_of_slot.index_select(0, slots)
        all_rows_tuned = rows <= self._tuned_prefix
        waiting = bool(self._waiting)
        # Every row of a tuned request that is not waiting advances, and is counted.
        advancing = (
            None if all_rows_tuned and not waiting else self._advancing.index_select(0, slots)
        )
        self.tuning.tune(
            logits, slots, keys, advancing, remember=waiting, all_rows_tuned=all_rows_tuned
        )
        self._key_of_slot.index_add_(0, slots, self._ones if advancing is None else advancing)
        return logits
