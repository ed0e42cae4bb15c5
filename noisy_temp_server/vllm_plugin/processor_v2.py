"""`NoisyTemperatureV2`: the T* processor under vLLM's Model Runner V2 (the CUDA default).

V2 keeps per-request state in persistent slots (``req_idx``) that it recycles: `add_request`
(re)initialises a slot completely, ``apply_staged_writes`` copies the staged admissions to the
device once per step, and `apply(logits, ctx)` sees every logits row of the step with its slot in
``ctx.expanded_idx_mapping`` (several rows per request under speculative decoding). The logits
are unscaled (the request temperature comes after); T* is applied to them, so the sampler's
later division by T_request gives the same ``T_request × T*`` as under the V1 runner.

The generation step of a row is computed on the device from vLLM's own state: the row samples
the token at position ``pos + 1``, so its step is ``pos + 1 - prompt_len[slot]``; a row of an
unfinished (chunked) prefill, ``pos + 1 < prefill_len[slot]``, is tuned like the first token but
not counted (vLLM discards its sample). vLLM sets both lengths when it admits a request into a
slot (``prefill_len``: the prompt plus the outputs of a resumed request) and keeps them for the
occupancy, so ``apply_staged_writes`` copies them, for the slots admitted since the last step,
into one table of our own: a step reads both, as step keys, with one gather. Rows of draft
tokens that the verifier later rejects are counted in the summaries and the histogram (they
cannot be told apart in ``apply``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from noisy_temp_server.engine_contract.request_args import NOT_ADMITTED
from noisy_temp_server.step.slot_tuning import STEP_STRIDE
from noisy_temp_server.vllm_plugin.processor_common import (
    TunedProcessor,
    admitted_request,
    build_slot_tuning,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["NoisyTemperatureV2"]

_HOLDS_TUNED = 1
"""Bit of a slot whose latest occupant is tuned or biased (`apply` changes its rows)."""
_HOLDS_UNTUNED = 2
"""Bit of a slot whose latest occupant has no T* (its bad rows are not counted)."""


class NoisyTemperatureV2(TunedProcessor, LogitsProcessor):
    """Divides each tuned row's unscaled logits by its T*.

    ``first``: ``(logits, ctx) -> logits``, work that must come before ours (the runtime noise:
    vLLM runs entry-point processors, ours, before class-path ones, so the noise processor
    hands it over, see `runtime_noise.RuntimeNoiseV2`); `apply` runs it before the capture and
    T*."""

    first: Callable[[torch.Tensor, LogitsContext], torch.Tensor] | None = None

    def __init__(
        self,
        vllm_config: VllmConfig,
        req_states: LogitsProcRequestState,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """vLLM's V2 constructor; ValueError when ``NTS_POLICY_FILE`` is set but invalid."""
        self._vllm_config = vllm_config  # keeps id(vllm_config) unique while self lives
        self._req_states = req_states
        capacity = req_states.max_num_reqs
        self.duplicate, self.tuning, self.capture = build_slot_tuning(
            self,
            vllm_config,
            capacity,
            req_states.device,
            logits_scaled=False,
            registry=registry,
            vocab_size=req_states.vocab_size,
        )
        if not self.duplicate and self.tuning.device.type == "cuda":  # compile the fused step now
            self.tuning.warm_up(req_states.vocab_size, torch.bool)
        # `_HOLDS_TUNED` | `_HOLDS_UNTUNED` bits of each slot's latest occupant. vLLM does not
        # say when a slot is freed, so a finished occupant's bits stay until it is re-admitted.
        self._slot_kinds = np.zeros(capacity, dtype=np.uint8)
        # Per slot, from its lengths (see the module docstring): the step key of position 0,
        # ``slot * STEP_STRIDE - (prompt_len - 1)``, the key of step 0, ``slot * STEP_STRIDE``,
        # and the first counted position, ``prefill_len - 1``.
        self._positions = torch.zeros(3, capacity, dtype=torch.int64, device=self.tuning.device)
        self._admitted: list[int] = []
        self._all_tuned = True  # no slot's latest occupant is untuned: no host work per step

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """Give slot ``req_idx`` to a new request; True when it is tuned, biased or captured."""
        admitted = NOT_ADMITTED if self.duplicate else admitted_request(sampling_params)
        resolved, correction = admitted.tuning, admitted.correction
        self.tuning.stage(req_idx, resolved, sampling_params.temperature, correction)
        tuned = resolved is not None or correction is not None
        self._slot_kinds[req_idx] = (_HOLDS_TUNED if tuned else 0) | (
            _HOLDS_UNTUNED if resolved is None else 0
        )
        self._admitted.append(req_idx)
        captured = self.capture.add_request(req_idx, sampling_params, admitted.capture_trace_id)
        return tuned or captured

    def apply_staged_writes(self) -> None:
        """Copy this step's admissions to the device (vLLM has written their lengths by now)."""
        self.tuning.flush_staged()
        if self._admitted:
            slots = np.asarray(self._admitted, dtype=np.int64)
            self._admitted.clear()
            step_zero = slots * STEP_STRIDE
            prompt_end = self._req_states.prompt_len.np[slots] - 1
            prefill_end = self._req_states.prefill_len.np[slots] - 1
            positions = np.stack((step_zero - prompt_end, step_zero, prefill_end))
            self._positions.index_copy_(1, self.tuning.upload(slots), self.tuning.upload(positions))
            self._all_tuned = not np.bitwise_or.reduce(self._slot_kinds) & _HOLDS_UNTUNED

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """logits: [rows, V] float32 unscaled, biased and divided in place on tuned rows.
        Captured rows (`capture`) are taken first, their steps from host state. No host sync."""
        if self.first is not None:
            logits = self.first(logits, ctx)
        if self.capture.active:
            self.capture.capture(logits, ctx.idx_mapping_np, self._host_steps(ctx))
        all_rows_tuned = self._all_tuned
        if not all_rows_tuned:  # some slot was untuned: read the step's own slots (one gather)
            kinds = np.bitwise_or.reduce(self._slot_kinds.take(ctx.idx_mapping_np))
            if not kinds & _HOLDS_TUNED:
                return logits
            all_rows_tuned = not kinds & _HOLDS_UNTUNED  # also once an untuned occupant is gone
        slots = ctx.expanded_idx_mapping
        position_zero, step_zero, prefill_end = self._positions.index_select(1, slots).unbind()
        keys = position_zero.add_(ctx.pos).clamp_(min=step_zero)  # a prefill chunk: step 0
        self.tuning.tune(
            logits,
            slots,
            keys,
            ctx.pos >= prefill_end,
            all_rows_tuned=all_rows_tuned,
            batch_slots=ctx.idx_mapping_np,  # finished slots keep their bias until reused
        )
        return logits

    def _host_steps(self, ctx: LogitsContext) -> np.ndarray:
        """The generation step of each request's row, from host state (exact without
        speculative decoding, the only case `capture` takes rows in): its sampled position is
        its sequence length; -1 for a row of an unfinished prefill (vLLM discards it)."""
        slots = ctx.idx_mapping_np
        sampled_position = ctx.seq_lens_upper_bound_np.astype(np.int64)
        steps = sampled_position - self._req_states.prompt_len.np[slots]
        return np.where(sampled_position >= self._req_states.prefill_len.np[slots], steps, -1)
