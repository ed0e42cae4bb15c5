"""The fused step of the table rules (`step.fused_table_step`, a Triton kernel) against the torch
path of `SlotTuning.tune`, in Triton's interpreter on the CPU: the same logits, T* summaries and
bad rows, over rows whose telling value sits in one block of the kernel's columns only (a last
live token, one NaN, one +inf), slots with two biases and none, an untuned slot, a traced slot,
a row not counted, and the tensors each vLLM runner hands over; and it falls back to the torch
path for tensors it does not take. On CUDA, `benchmarks/gpu_check.py` runs the same comparison.

Triton's interpreter must be chosen before Triton is first imported, so the comparisons run in a
fresh interpreter with ``TRITON_INTERPRET=1`` (`test_in_the_interpreter`); in the suite's own
process they are skipped."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from noisy_temp_server.correction.files import bias_sha256
from noisy_temp_server.engine_contract.request_args import (
    parse_request_args,
    resolve_correction,
    resolve_request,
)
from noisy_temp_server.step.engine_metrics import step_temperature_metrics
from noisy_temp_server.step.logit_bias import CorrectionSource
from noisy_temp_server.step.reports import Reporter
from noisy_temp_server.step.slot_tuning import STEP_STRIDE, SlotTuning
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

VOCAB = 9_001  # three blocks of the kernel's 4 096 columns
SLOTS = 6
_EDGES = (0, 4, 16)
_BIASES = [0.5 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
_BY_HASH = {bias_sha256(bias): bias for bias in _BIASES}
_SQRT = TemperaturePolicy(
    rule=Rule.SQRT, step_edges=_EDGES, alpha_by_step=(0.5, 0.3, 0.1), sigma2_by_step=(0.0,) * 3
)
_FIXED = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3)
_SLOT_POLICIES = {  # slot -> (policy, its bias); slot 4 stays untuned
    0: (_FIXED, 0),
    1: (_SQRT, 1),
    2: (_SQRT, None),
    3: (_FIXED, 0),
    5: (TemperaturePolicy(rule=Rule.LINEAR, step_edges=(0,), alpha_by_step=(0.2,)), None),
}
ROW_SLOTS = [0, 1, 2, 3, 4, 5, 0]
ROW_STEPS = [3, 5, 17, 0, 2, 9, 4]
COUNTED = [True, True, True, True, True, True, False]  # the last: a draft row not kept


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(
    not _INTERPRETED, reason="run in Triton's interpreter by test_in_the_interpreter"
)


@pytest.mark.skipif(_INTERPRETED, reason="this is the run it starts")
def test_in_the_interpreter() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "8 passed" in done.stdout, done.stdout[-2000:]


@dataclasses.dataclass
class _Launches:
    """Counts the fused kernel's runs (calls that returned True) of one `SlotTuning`."""

    tuning: SlotTuning
    count: int = 0

    def __post_init__(self) -> None:
        kernel = self.tuning.fused_step

        def counted(*args: Any, **kwargs: Any) -> bool:
            assert kernel is not None
            ran = bool(kernel(*args, **kwargs))
            self.count += ran
            return ran

        if kernel is not None:
            self.tuning.fused_step = counted


def _tuning(*, fused: bool, reporting: bool) -> tuple[SlotTuning, Reporter | None, _Launches]:
    reporter = None
    if reporting:
        metrics = step_temperature_metrics(CollectorRegistry())
        reporter = Reporter(None, metrics, slots=SLOTS + 1, interval_s=3600.0)
    tuning = SlotTuning(
        SLOTS,
        torch.device("cpu"),
        logits_scaled=False,
        reporter=reporter,
        vocab_size=VOCAB,
        corrections=CorrectionSource(bias=_BY_HASH.__getitem__),
        fused_step=fused,
    )
    hashes = list(_BY_HASH)
    for slot in range(SLOTS):
        policy, bias = _SLOT_POLICIES.get(slot, (None, None))
        if policy is None:
            tuning.stage(slot, None, 1.0)
            continue
        if bias is not None:
            policy = dataclasses.replace(policy, bias=hashes[bias])
        extra_args = {"nts_policy": policy.to_json(), "nts_trace_id": f"request-{slot}"}
        keys = parse_request_args(extra_args | {"nts_trace": slot == 1})
        tuning.stage(slot, resolve_request(keys, 1.0), 1.0, resolve_correction(keys))
    tuning.flush_staged()
    return tuning, reporter, _Launches(tuning)


def _logits(step: int) -> torch.Tensor:
    """The step's served rows, as a view of wider rows (unit column stride, as vLLM's)."""
    generator = torch.Generator().manual_seed(step)
    logits = torch.randn(len(ROW_SLOTS), VOCAB + 7, generator=generator)[:, :VOCAB]
    logits[1] = -torch.inf
    logits[1, VOCAB - 1] = 0.5  # live in the last block only: not bad
    logits[2] = -torch.inf  # all masked: bad
    logits[3, 8_999] = torch.nan  # NaN in the last block: bad
    logits[4] = torch.nan  # bad, but its slot is untuned
    logits[5, 5_000] = torch.inf  # +inf in the middle block: bad
    return logits


@dataclasses.dataclass(frozen=True)
class _Runner:
    """How a vLLM runner hands a step to `SlotTuning.tune`."""

    slot_dtype: torch.dtype
    counted: str  # "bool", "int64" (0/1) or "none" (every row counted)
    batch_slots: bool  # V2 names the batch's slots on the host

    def counted_rows(self) -> torch.Tensor | None:
        flags = torch.tensor(COUNTED)
        return {"bool": flags, "int64": flags.long(), "none": None}[self.counted]


RUNNERS = {
    "v2": _Runner(torch.int32, "bool", batch_slots=True),
    "v1": _Runner(torch.int64, "int64", batch_slots=False),
    "v1-all-counted": _Runner(torch.int64, "none", batch_slots=False),
}


def _steps(
    built: tuple[SlotTuning, Reporter | None, _Launches], runner: _Runner, *, all_rows_tuned: bool
) -> tuple[list[torch.Tensor], object, float]:
    """Two steps (the second two generation steps on), then what was accounted."""
    tuning, reporter, _ = built
    tuned_rows = []
    for step in (0, 2):
        logits = _logits(step)
        slots = torch.tensor(ROW_SLOTS, dtype=runner.slot_dtype)
        keys = slots.long() * STEP_STRIDE + torch.tensor(ROW_STEPS) + step
        tuning.tune(
            logits,
            slots,
            keys,
            runner.counted_rows(),
            all_rows_tuned=all_rows_tuned,
            batch_slots=np.asarray(ROW_SLOTS) if runner.batch_slots else None,
        )
        tuned_rows.append(logits)
    if reporter is None:
        return tuned_rows, None, 0.0
    reporter.close()
    return tuned_rows, tuning.summaries(), float(tuning.bad_rows)


@interpreted_only
@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("all_rows_tuned", [False, True])
def test_the_kernel_does_what_the_torch_path_does(runner: str, all_rows_tuned: bool) -> None:
    reference, fused = _tuning(fused=False, reporting=True), _tuning(fused=True, reporting=True)
    want = _steps(reference, RUNNERS[runner], all_rows_tuned=all_rows_tuned)
    got = _steps(fused, RUNNERS[runner], all_rows_tuned=all_rows_tuned)
    assert (reference[2].count, fused[2].count) == (0, 2)  # the kernel ran both steps
    for tuned, expected in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(tuned, expected, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]))
    bad_per_step = 4.0 if all_rows_tuned else 3.0  # the fixture's bad rows (row 4's is untuned)
    assert want[2] == 2 * bad_per_step
    assert got[2] == want[2]


@interpreted_only
def test_without_a_reporter_it_only_tunes() -> None:
    fused = _tuning(fused=True, reporting=False)
    want = _steps(_tuning(fused=False, reporting=False), RUNNERS["v2"], all_rows_tuned=False)
    got = _steps(fused, RUNNERS["v2"], all_rows_tuned=False)
    assert fused[2].count == 2
    for tuned, expected in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(tuned, expected, equal_nan=True, rtol=0, atol=0)
    assert not torch.equal(got[0][0].nan_to_num(), _logits(0)[0].nan_to_num())  # it did divide


@interpreted_only
def test_tensors_it_does_not_take_go_down_the_torch_path() -> None:
    from noisy_temp_server.step.fused_table_step import fused_table_step  # noqa: PLC0415

    tuning, _, _ = _tuning(fused=True, reporting=False)
    slots, keys = torch.tensor([0, 1]), torch.tensor([0, STEP_STRIDE])
    arguments: dict[str, Any] = {
        "edge_keys": tuning.edge_keys,
        "cell_table": tuning.cell_table,
        "bias_rows": tuning.bias.slot_rows,
        "bias_table": tuning.bias.table,
        "temperature": torch.empty(2),
        "accounts": None,
        "counted": None,
        "tuned": None,
    }
    half = torch.zeros(2, VOCAB, dtype=torch.float16)
    assert not fused_table_step(half, slots, keys, **arguments)
    narrower = torch.zeros(2, VOCAB - 1)  # not the bias table's width
    assert not fused_table_step(narrower, slots, keys, **arguments)
    assert torch.equal(narrower, torch.zeros(2, VOCAB - 1))
    strided = torch.tensor([0, 9, 1, 9])[::2]
    assert not fused_table_step(torch.zeros(2, VOCAB), strided, keys, **arguments)
    assert not fused_table_step(torch.zeros(3, VOCAB), slots, keys, **arguments)  # 2 slots, 3 rows
    assert fused_table_step(torch.zeros(2, VOCAB), slots, keys, **arguments)
