"""The fused step of the table rules (`step.fused_table_step`, a Triton kernel) against the torch
path of `SlotTuning.tune`, in Triton's interpreter on the CPU: the same logits, T* summaries and
bad rows, over rows whose telling value sits in one block of the kernel's columns only (a last
live token, one NaN, one +inf), slots with two biases and none, an untuned slot and a row not
counted. On CUDA, `benchmarks/gpu_check.py` runs the same comparison.

Triton's interpreter must be chosen before Triton is first imported, so the comparisons run in a
fresh interpreter with ``TRITON_INTERPRET=1`` (`test_in_the_interpreter`); in the suite's own
process they are skipped."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

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
    assert "4 passed" in done.stdout, done.stdout[-2000:]


def _tuning(*, fused: bool, reporting: bool) -> tuple[SlotTuning, Reporter | None]:
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
        keys = parse_request_args({"nts_policy": policy.to_json()})
        tuning.stage(slot, resolve_request(keys, 1.0), 1.0, resolve_correction(keys))
    tuning.flush_staged()
    return tuning, reporter


def _logits() -> torch.Tensor:
    logits = torch.randn(len(ROW_SLOTS), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1] = -torch.inf
    logits[1, VOCAB - 1] = 0.5  # live in the last chunk only: not bad
    logits[2] = -torch.inf  # all masked: bad
    logits[3, 8_999] = torch.nan  # NaN in the last chunk: bad
    logits[4] = torch.nan  # bad, but its slot is untuned
    logits[5, 5_000] = torch.inf  # +inf in the middle chunk: bad
    return logits


def _step(
    tuning: SlotTuning, reporter: Reporter | None, *, all_rows_tuned: bool
) -> tuple[torch.Tensor, object, float]:
    logits = _logits()
    slots = torch.tensor(ROW_SLOTS)
    keys = slots * STEP_STRIDE + torch.tensor(ROW_STEPS)
    tuning.tune(logits, slots, keys, torch.tensor(COUNTED), all_rows_tuned=all_rows_tuned)
    if reporter is None:
        return logits, None, 0.0
    reporter.close()
    return logits, tuning.summaries(), float(tuning.bad_rows)


@interpreted_only
@pytest.mark.parametrize("all_rows_tuned", [False, True])
def test_the_kernel_does_what_the_torch_path_does(all_rows_tuned: bool) -> None:
    want = _step(*_tuning(fused=False, reporting=True), all_rows_tuned=all_rows_tuned)
    got = _step(*_tuning(fused=True, reporting=True), all_rows_tuned=all_rows_tuned)
    torch.testing.assert_close(got[0], want[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]))
    assert want[2] == (4.0 if all_rows_tuned else 3.0)  # the fixture's bad rows, as the reference
    assert got[2] == want[2]


@interpreted_only
def test_without_a_reporter_it_only_tunes() -> None:
    want = _step(*_tuning(fused=False, reporting=False), all_rows_tuned=False)[0]
    got = _step(*_tuning(fused=True, reporting=False), all_rows_tuned=False)[0]
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert not torch.equal(got[0].nan_to_num(), _logits()[0].nan_to_num())  # it did divide


@interpreted_only
def test_refuses_what_it_cannot_run() -> None:
    from noisy_temp_server.step.fused_table_step import fused_table_step  # noqa: PLC0415

    tuning, _ = _tuning(fused=True, reporting=False)
    with pytest.raises(ValueError, match="float32"):
        fused_table_step(
            torch.zeros(2, VOCAB, dtype=torch.float16),
            torch.tensor([0, 1]),
            torch.tensor([0, STEP_STRIDE]),
            edge_keys=tuning.edge_keys,
            cell_table=tuning.cell_table,
            bias_rows=None,
            bias_table=tuning.bias.table,
            temperature=torch.empty(2),
            accounts=None,
            counted=None,
            tuned=None,
        )
