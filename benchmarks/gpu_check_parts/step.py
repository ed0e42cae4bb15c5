"""The per-step work of the T* processor, driven as Model Runner V2 drives it, without vLLM: the
harness of `gpu_check.py`.

A `StepHarness` holds the real step objects of one processor (`SlotTuning` with its `SlotBias`,
a `RowCapture`, a `Reporter` whose sender records what it would send) for one case: a rule, a
correction (none, or a per-token bias), a batch and a vocabulary.
Every slot of the batch holds a request of that case's policy with a trace id; every fourth is
traced (``nts_trace``), every third captured (``nts_capture``). `StepHarness.step` does what
``NoisyTemperatureV2.apply`` does on the device: the capture of the served rows, then
``SlotTuning.tune`` (bias, T*, accounting, the reporter's snapshot).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from noisy_temp_server.correction.files import bias_sha256
from noisy_temp_server.engine_contract.request_args import admit_request
from noisy_temp_server.step.capture import CaptureBounds, RowCapture
from noisy_temp_server.step.engine_metrics import step_temperature_metrics
from noisy_temp_server.step.logit_bias import CorrectionSource
from noisy_temp_server.step.reports import Reporter
from noisy_temp_server.step.slot_tuning import STEP_STRIDE, SlotTuning
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

_EDGES = (0, 8, 32, 128, 512)
_ALPHAS = (0.3, 0.2, 0.1, 0.05, 0.02)
_NONE = (0.0,) * len(_EDGES)
POLICIES: dict[str, TemperaturePolicy] = {
    "off": TemperaturePolicy(rule=Rule.OFF),
    "fixed": TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3),
    "sqrt": TemperaturePolicy(
        rule=Rule.SQRT, step_edges=_EDGES, alpha_by_step=_ALPHAS, sigma2_by_step=_NONE
    ),
    "linear": TemperaturePolicy(
        rule=Rule.LINEAR, step_edges=_EDGES, alpha_by_step=_ALPHAS, sigma2_by_step=_NONE
    ),
    "calibrated": TemperaturePolicy(
        rule=Rule.CALIBRATED,
        calibrated=CalibratedTable(step_edges=(0, 8, 32), temperatures=(((1.4,), (1.2,), (0.9,)),)),
    ),
    "schedule": TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=1.5, schedule_beta=0.05),
    "fisher": TemperaturePolicy(
        rule=Rule.FISHER, step_edges=_EDGES, alpha_by_step=_NONE, sigma2_by_step=_ALPHAS
    ),
    "calibrated_entropy": TemperaturePolicy(
        rule=Rule.CALIBRATED,
        calibrated=CalibratedTable(
            step_edges=(0, 8), entropy_edges=(0.0, 6.0), temperatures=(((1.3, 1.1), (1.2, 0.95)),)
        ),
    ),
}
"""A policy per rule: the table rules (T* from the step alone: `TABLE_RULES`), ``schedule``,
and the rules that read the served row (``fisher``, a calibrated table over the entropy)."""
TABLE_RULES = ("off", "fixed", "sqrt", "linear", "calibrated")
CORRECTIONS = ("none", "bias")
REQUEST_TEMPERATURE = 0.8
STEPS = (0, 9, 40)
"""The generation steps of a case's steps: three step buckets of the tables."""


@dataclasses.dataclass(frozen=True)
class Correction:
    """A random per-token bias of ``vocab`` entries with its content hash (what a policy names
    it by)."""

    bias: torch.Tensor
    bias_sha256: str

    @classmethod
    def random(cls, vocab: int, generator: torch.Generator) -> Correction:
        bias = 0.5 * torch.randn(vocab, generator=generator)
        return cls(bias, bias_sha256(bias))

    def source(self) -> CorrectionSource:
        """Where `SlotBias` finds the vector (instead of the bias directories)."""

        def bias(sha256: str) -> torch.Tensor:
            if sha256 != self.bias_sha256:
                raise ValueError(f"no bias {sha256}")
            return self.bias

        return CorrectionSource(bias=bias)

    def policy(self, policy: TemperaturePolicy, correction: str) -> TemperaturePolicy:
        """``policy`` with this bias (``bias``), or as it is (``none``)."""
        if correction == "none":
            return policy
        return dataclasses.replace(policy, bias=self.bias_sha256)


class RecordingSender:
    """Stands in for the trace channel's `TraceSender`: keeps what the reporter sends."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, float]] = []
        self.summaries: list[tuple[str, int, float, int, float, float]] = []
        self.rows: list[tuple[list[tuple[str, int]], np.ndarray]] = []

    def send_step(self, records: Sequence[tuple[str, int, float]]) -> bool:
        self.steps.extend(records)
        return True

    def send_summaries(self, records: Sequence[tuple[str, int, float, int, float, float]]) -> bool:
        self.summaries.extend(records)
        return True

    def send_rows(
        self,
        records: Sequence[tuple[str, int]],
        rows: np.ndarray,
        dropped: Sequence[tuple[str, int]] = (),
        drop_counts: Mapping[str, int] | None = None,
    ) -> bool:
        self.rows.append((list(records), rows.copy()))
        return True


def _extra_args(policy: TemperaturePolicy, slot: int, observed: bool) -> dict[str, Any]:
    return {
        "nts_policy": policy.to_json(),
        "nts_trace_id": f"request-{slot}",
        "nts_trace": observed and slot % 4 == 0,
        "nts_capture": observed and slot % 3 == 0,
    }


class StepHarness:
    """One processor's step objects on ``device`` for ``batch`` requests of ``policy`` over
    ``vocab`` tokens (see the module docstring). ``report_interval_s``: the reporter thread's
    period (a long one: nothing is delivered before `close`, as the correctness check wants).
    ``fused_step``: `SlotTuning`'s (None: the fused kernels on CUDA, where Triton imports),
    warmed up as the processor's construction does; ``programs``: the fused step's (below
    this many rows it splits rows into chunks; None: the device's default).
    ``observed`` False: no slot is traced or captured (what most of live traffic is)."""

    def __init__(
        self,
        policy: TemperaturePolicy,
        batch: int,
        vocab: int,
        device: torch.device,
        *,
        corrections: CorrectionSource,
        report_interval_s: float,
        fused_step: bool | None = None,
        programs: int | None = None,
        observed: bool = True,
    ) -> None:
        self.device = device
        self.sender = RecordingSender()
        self.registry = CollectorRegistry()
        metrics = step_temperature_metrics(self.registry)
        reporter = Reporter(self.sender, metrics, slots=batch + 1, interval_s=report_interval_s)
        pin = device.type == "cuda"
        self.tuning = SlotTuning(
            batch,
            device,
            logits_scaled=False,
            reporter=reporter,
            pin_memory=pin,
            vocab_size=vocab,
            corrections=corrections,
            fused_step=fused_step,
        )
        if self.tuning.fused_step is not None and programs is not None:
            self.tuning.fused_step.programs = programs
        self.tuning.warm_up(vocab, torch.bool)  # as `NoisyTemperatureV2` does
        self.capture = RowCapture(
            batch, reporter, CaptureBounds(), logits_scaled=False, pin_memory=pin
        )
        self.reporter = reporter
        for slot in range(batch):
            extra_args = _extra_args(policy, slot, observed)
            admitted = admit_request(extra_args, REQUEST_TEMPERATURE)
            self.tuning.stage(slot, admitted.tuning, REQUEST_TEMPERATURE, admitted.correction)
            self.capture.admit(slot, admitted.capture_trace_id, REQUEST_TEMPERATURE, [])
        self.tuning.flush_staged()
        self.slots_np = np.arange(batch, dtype=np.int64)
        self.slots = torch.from_numpy(self.slots_np).to(device)
        # Every seventh row is a prefill chunk's: the engine discards its sample (not counted).
        self.counted = (torch.arange(batch) % 7 != 6).to(device)

    def keys(self, step: int) -> tuple[torch.Tensor, np.ndarray]:
        """The rows' step keys on the device and their generation steps on the host."""
        keys = self.slots.long() * STEP_STRIDE + step
        return keys, np.full(len(self.slots_np), step, dtype=np.int64)

    def step(
        self,
        logits: torch.Tensor,
        keys: torch.Tensor,
        steps: np.ndarray,
        *,
        all_rows_tuned: bool = True,
    ) -> None:
        """One step on ``logits`` [B, V] (in place), as ``NoisyTemperatureV2.apply``
        (``all_rows_tuned`` False: as after an untuned request held a slot, which makes the step
        check each row's slot; every slot here is tuned, so the result is the same)."""
        if self.capture.active:
            self.capture.capture(logits, self.slots_np, steps)
        self.tuning.tune(
            logits,
            self.slots,
            keys,
            self.counted,
            all_rows_tuned=all_rows_tuned,
            batch_slots=self.slots_np,
        )

    def close(self) -> None:
        """Stop the reporter after delivering everything staged."""
        self.reporter.close()

    def delivered(self) -> dict[str, Any]:
        """What the step delivered to the host: summaries, traces, captured rows, bad rows and
        the histogram's count and sum (after `close`)."""
        histogram = {"count": 0.0, "sum": 0.0}
        for metric in self.registry.collect():
            for sample in metric.samples:
                part = sample.name.removeprefix("nts_step_temperature_")
                if part in histogram:
                    histogram[part] += sample.value
        return {
            "state": self.tuning.summaries(),
            "summaries": sorted(self.sender.summaries),
            "traces": list(self.sender.steps),
            "rows": list(self.sender.rows),
            "bad_rows": self.reporter.bad_rows,
            "histogram": histogram,
        }


def served_logits(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random served logits [batch, vocab] on the CPU, rows of four spreads (so that their
    entropies fall on both sides of `POLICIES`' calibrated entropy edge), with what the step
    must carry through from batch 4 on: a row with masked (-inf) entries, a NaN row and an
    all-masked row."""
    spread = 2.0 + 3.0 * (torch.arange(batch) % 4).unsqueeze(1)
    logits = spread * torch.randn(batch, vocab, generator=generator)
    if batch >= 4:
        logits[1, torch.randperm(vocab, generator=generator)[: vocab // 2]] = -torch.inf
        logits[2] = torch.nan
        logits[3] = -torch.inf
    return logits
