"""The fused step (`step.fused_step`, Triton kernels) against the torch path of
`SlotTuning.tune`, in Triton's interpreter on the CPU: the same logits, T* summaries, bad rows
and traces, over rows whose telling value sits in one block of the kernel's columns only (a
last live token, one NaN, one +inf), slots with two biases and none, an untuned slot, a traced
slot, a row not counted, and the tensors each vLLM runner hands over; for the table rules bit
for bit, for ``schedule`` and the rules that read the served row (``fisher``, a calibrated table
over the entropy, rows of many entropies) within float32 rounding, rows whole and split into
chunks; the warm-up touches nothing; and it falls back to the torch path for tensors it does
not take. Both kernels also compile for sm_90 (no GPU needed). On
CUDA, `benchmarks/gpu_check.py` runs the same comparison.

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
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds

VOCAB = 9_001  # three blocks of the kernel's 4 096 columns
_EDGES = (0, 4, 16)
_BIASES = [0.5 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
_BY_HASH = {bias_sha256(bias): bias for bias in _BIASES}
_SQRT = TemperaturePolicy(
    rule=Rule.SQRT, step_edges=_EDGES, alpha_by_step=(0.5, 0.3, 0.1), sigma2_by_step=(0.0,) * 3
)
_FIXED = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3)
_SCHEDULE = TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=1.5, schedule_beta=0.05)
_FISHER = TemperaturePolicy(
    rule=Rule.FISHER,
    step_edges=_EDGES,
    alpha_by_step=(0.0,) * 3,
    sigma2_by_step=(2.0, 0.5, 0.0),
    fisher_var_floor=0.2,
)
_OVER_ENTROPY = TemperaturePolicy(  # two request-temperature bands, step edges of its own
    rule=Rule.CALIBRATED,
    step_edges=(0, 10),
    alpha_by_step=(0.0, 0.0),
    sigma2_by_step=(0.0, 0.0),
    calibrated=CalibratedTable(
        step_edges=(0, 4),
        entropy_edges=(0.0, 2.0, 6.0),
        request_temperature_edges=(0.0, 0.9),
        temperatures=(((1.3, 1.1, 0.9), (1.2, 0.95, 0.8)), ((1.5, 1.0, 0.7), (1.1, 1.05, 3.0))),
    ),
    bounds=TemperatureBounds(t_min=0.75, t_max=2.5),
)


@dataclasses.dataclass(frozen=True)
class _Case:
    """Slots (slot -> policy, its bias, the request temperature; others untuned) and the rows
    of a step: each row's slot, step and whether it is counted, and the spread of its values."""

    slots: dict[int, tuple[TemperaturePolicy, int | None, float]]
    row_slots: list[int]
    row_steps: list[int]
    counted: list[bool]
    spreads: list[float]


TABLES = _Case(  # slot 4 stays untuned; the last row: a draft row not kept
    slots={
        0: (_FIXED, 0, 1.0),
        1: (_SQRT, 1, 1.0),
        2: (_SQRT, None, 1.0),
        3: (_FIXED, 0, 1.0),
        5: (TemperaturePolicy(rule=Rule.LINEAR, step_edges=(0,), alpha_by_step=(0.2,)), None, 1.0),
    },
    row_slots=[0, 1, 2, 3, 4, 5, 0],
    row_steps=[3, 5, 17, 0, 2, 9, 4],
    counted=[True, True, True, True, True, True, False],
    spreads=[1.0] * 7,
)
EVERY_RULE = _Case(  # rows 1-5 as in TABLES (see `_logits`); entropies from ~0 to ~9 nats
    slots={
        0: (_SCHEDULE, 0, 0.7),
        1: (_FISHER, 1, 0.7),
        2: (_OVER_ENTROPY, None, 0.7),
        3: (_FISHER, 0, 1.0),
        5: (_OVER_ENTROPY, 0, 1.2),
        6: (_SQRT, None, 1.0),
    },
    row_slots=[0, 1, 2, 3, 4, 5, 6, 1, 2, 5, 3, 0],
    row_steps=[3, 5, 17, 0, 2, 9, 4, 1, 3, 30, 15, 60],
    counted=[True, True, True, True, True, True, True, True, False, True, True, True],
    spreads=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.3, 3.0, 10.0, 30.0, 5.0, 2.0],
)


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
    assert "14 passed" in done.stdout, done.stdout[-2000:]


@dataclasses.dataclass
class _Launches:
    """Counts the fused kernel's runs (calls that returned True) of one `SlotTuning`."""

    tuning: SlotTuning
    count: int = 0
    kernel: Any = None

    def __post_init__(self) -> None:
        kernel = self.tuning.fused_step

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor | None:
            assert kernel is not None
            temperature = kernel(*args, **kwargs)
            self.count += temperature is not None
            return temperature

        if kernel is not None:
            self.kernel = kernel
            self.tuning.fused_step = counted  # type: ignore[assignment]


class _Traces:
    """Keeps the step traces a `Reporter` sends (and drops its other messages)."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, float]] = []

    def send_step(self, records: list[tuple[str, int, float]]) -> bool:
        self.steps.extend(records)
        return True

    def send_summaries(self, records: object) -> bool:
        return True

    def send_rows(self, *parts: object) -> bool:
        return True


def _tuning(
    case: _Case, *, fused: bool, reporting: bool, logits_scaled: bool = False, programs: int = 0
) -> tuple[SlotTuning, Reporter | None, _Launches]:
    """A `SlotTuning` holding ``case``'s slots (slot 1 traced); ``programs``: its fused step's."""
    slots = max(case.row_slots) + 1
    reporter = None
    if reporting:
        metrics = step_temperature_metrics(CollectorRegistry())
        reporter = Reporter(_Traces(), metrics, slots=slots + 1, interval_s=3600.0)
    tuning = SlotTuning(
        slots,
        torch.device("cpu"),
        logits_scaled=logits_scaled,
        reporter=reporter,
        vocab_size=VOCAB,
        corrections=CorrectionSource(bias=_BY_HASH.__getitem__),
        fused_step=fused,
    )
    if tuning.fused_step is not None:
        tuning.fused_step.programs = programs
    hashes = list(_BY_HASH)
    for slot in range(slots):
        policy, bias, temperature = case.slots.get(slot, (None, None, 1.0))
        if policy is None:
            tuning.stage(slot, None, temperature)
            continue
        if bias is not None:
            policy = dataclasses.replace(policy, bias=hashes[bias])
        extra_args = {"nts_policy": policy.to_json(), "nts_trace_id": f"request-{slot}"}
        keys = parse_request_args(extra_args | {"nts_trace": slot == 1})
        resolved = resolve_request(keys, temperature)
        tuning.stage(slot, resolved, temperature, resolve_correction(keys))
    tuning.flush_staged()
    return tuning, reporter, _Launches(tuning)


def _logits(case: _Case, step: int) -> torch.Tensor:
    """The step's served rows, as a view of wider rows (unit column stride, as vLLM's)."""
    generator = torch.Generator().manual_seed(step)
    rows = len(case.row_slots)
    logits = torch.randn(rows, VOCAB + 7, generator=generator)[:, :VOCAB]
    logits.mul_(torch.tensor(case.spreads).unsqueeze(1))
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
    logits_scaled: bool = False  # V1 without a bias directory: z~ / T_req

    def counted_rows(self, case: _Case) -> torch.Tensor | None:
        flags = torch.tensor(case.counted)
        return {"bool": flags, "int64": flags.long(), "none": None}[self.counted]


RUNNERS = {
    "v2": _Runner(torch.int32, "bool", batch_slots=True),
    "v1": _Runner(torch.int64, "int64", batch_slots=False),
    "v1-all-counted": _Runner(torch.int64, "none", batch_slots=False),
    "v1-scaled": _Runner(torch.int64, "int64", batch_slots=False, logits_scaled=True),
}


def _steps(
    case: _Case,
    built: tuple[SlotTuning, Reporter | None, _Launches],
    runner: _Runner,
    *,
    all_rows_tuned: bool,
) -> tuple[list[torch.Tensor], object, float]:
    """Two steps (the second two generation steps on), then what was accounted."""
    tuning, reporter, _ = built
    tuned_rows = []
    for step in (0, 2):
        logits = _logits(case, step)
        slots = torch.tensor(case.row_slots, dtype=runner.slot_dtype)
        keys = slots.long() * STEP_STRIDE + torch.tensor(case.row_steps) + step
        tuning.tune(
            logits,
            slots,
            keys,
            runner.counted_rows(case),
            all_rows_tuned=all_rows_tuned,
            batch_slots=np.asarray(case.row_slots) if runner.batch_slots else None,
        )
        tuned_rows.append(logits)
    if reporter is None:
        return tuned_rows, None, 0.0
    reporter.close()
    return tuned_rows, tuning.summaries(), float(tuning.bad_rows)


@interpreted_only
@pytest.mark.parametrize("runner", ["v2", "v1", "v1-all-counted"])
@pytest.mark.parametrize("all_rows_tuned", [False, True])
def test_the_kernel_does_what_the_torch_path_does(runner: str, all_rows_tuned: bool) -> None:
    reference = _tuning(TABLES, fused=False, reporting=True)
    fused = _tuning(TABLES, fused=True, reporting=True)
    want = _steps(TABLES, reference, RUNNERS[runner], all_rows_tuned=all_rows_tuned)
    got = _steps(TABLES, fused, RUNNERS[runner], all_rows_tuned=all_rows_tuned)
    assert (reference[2].count, fused[2].count) == (0, 2)  # the kernel ran both steps
    for tuned, expected in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(tuned, expected, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]))
    bad_per_step = 4.0 if all_rows_tuned else 3.0  # the fixture's bad rows (row 4's is untuned)
    assert want[2] == 2 * bad_per_step
    assert got[2] == want[2]


@interpreted_only
@pytest.mark.parametrize("runner", ["v2", "v1-scaled"])
@pytest.mark.parametrize("programs", [0, 40])  # 40: rows of three chunks
def test_every_rule_does_what_the_torch_path_does(runner: str, programs: int) -> None:
    scaled = RUNNERS[runner].logits_scaled
    reference = _tuning(EVERY_RULE, fused=False, reporting=True, logits_scaled=scaled)
    fused = _tuning(EVERY_RULE, fused=True, reporting=True, logits_scaled=scaled, programs=programs)
    want = _steps(EVERY_RULE, reference, RUNNERS[runner], all_rows_tuned=False)
    got = _steps(EVERY_RULE, fused, RUNNERS[runner], all_rows_tuned=False)
    assert fused[2].count == 2
    for tuned, expected in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(tuned, expected, equal_nan=True, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=2e-5, atol=0)
    assert got[2] == want[2] == 2 * 3.0
    traces = [reporter.sender.steps for reporter in (reference[1], fused[1])]  # type: ignore[union-attr]
    assert [record[:2] for record in traces[1]] == [record[:2] for record in traces[0]]
    slot_1 = [("request-1", 5), ("request-1", 1), ("request-1", 7), ("request-1", 3)]
    assert [record[:2] for record in traces[0]] == slot_1  # its rows of both steps
    torch.testing.assert_close(
        torch.tensor([r[2] for r in traces[1]]),
        torch.tensor([r[2] for r in traces[0]]),
        rtol=2e-5,
        atol=0,
    )
    temperatures = _logits(EVERY_RULE, 2).nan_to_num() / got[0][1].nan_to_num()
    distinct = {round(float(t), 3) for t in temperatures[6:, 0]}
    assert len(distinct) >= 5  # the rows' T* differ: the test can tell them apart


@interpreted_only
def test_without_a_reporter_it_only_tunes() -> None:
    fused = _tuning(TABLES, fused=True, reporting=False)
    reference = _tuning(TABLES, fused=False, reporting=False)
    want = _steps(TABLES, reference, RUNNERS["v2"], all_rows_tuned=False)
    got = _steps(TABLES, fused, RUNNERS["v2"], all_rows_tuned=False)
    assert fused[2].count == 2
    for tuned, expected in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(tuned, expected, equal_nan=True, rtol=0, atol=0)
    assert not torch.equal(got[0][0].nan_to_num(), _logits(TABLES, 0)[0].nan_to_num())


@interpreted_only
def test_the_warm_up_touches_nothing_of_the_processor() -> None:
    tuning, reporter, launches = _tuning(EVERY_RULE, fused=True, reporting=True)
    before = tuning.state.clone(), tuning.cell_table.clone(), tuning.bias.table.clone()
    launches.kernel.warm_up(VOCAB, counted=torch.bool, accounting=True, logits_scaled=False)
    assert launches.kernel.programs == 0  # as it was
    after = tuning.state, tuning.cell_table, tuning.bias.table
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert reporter is not None
    reporter.close()


@interpreted_only
def test_tensors_it_does_not_take_go_down_the_torch_path() -> None:
    tuning, _, launches = _tuning(TABLES, fused=True, reporting=False)
    step = launches.kernel
    slots, keys = torch.tensor([0, 1]), torch.tensor([0, STEP_STRIDE])
    arguments: dict[str, Any] = {
        "tables": tuning._step_tables(),
        "bias_rows": tuning.bias.slot_rows,
        "tuned": None,
        "accounts": None,
        "schedule": False,
        "reading": False,
        "logits_scaled": False,
    }
    half = torch.zeros(2, VOCAB, dtype=torch.float16)
    assert step(half, slots, keys, None, **arguments) is None
    narrower = torch.zeros(2, VOCAB - 1)  # not the bias table's width
    assert step(narrower, slots, keys, None, **arguments) is None
    assert torch.equal(narrower, torch.zeros(2, VOCAB - 1))
    strided = torch.tensor([0, 9, 1, 9])[::2]
    assert step(torch.zeros(2, VOCAB), strided, keys, None, **arguments) is None
    assert step(torch.zeros(3, VOCAB), slots, keys, None, **arguments) is None  # 2 slots, 3 rows
    assert step(torch.zeros(2, VOCAB), slots, keys, None, **arguments) is not None


def test_small_batches_split_rows_into_chunks_of_whole_blocks() -> None:
    from noisy_temp_server.step.fused_step import chunking  # noqa: PLC0415

    assert chunking(256, 128_256, 264) == (1, 32 * 4096)  # enough rows: whole rows
    assert chunking(64, 128_256, 264) == (4, 8 * 4096)
    assert chunking(1, 128_256, 264) == (32, 4096)  # at most a block each
    assert chunking(3, 9_001, 40) == (3, 4096)
    assert chunking(5, 100, 0) == (1, 4096)


_POINTERS = {
    "logits_ptr": "*fp32",
    "slots_ptr": "*i64",
    "keys_ptr": "*i64",
    "tuned_ptr": "*i1",
    "edge_keys_ptr": "*i64",
    "cell_table_ptr": "*fp32",
    "bias_rows_ptr": "*i64",
    "bias_table_ptr": "*fp32",
    "reads_ptr": "*fp32",
    "read_values_ptr": "*fp32",
    "request_temperature_ptr": "*fp32",
    "accumulators_ptr": "*fp64",
    "extrema_ptr": "*fp64",
    "bad_rows_ptr": "*fp64",
    "trace_ptr": "*fp32",
    "traced_ptr": "*i1",
    "partials_ptr": "*fp32",
    "flags_ptr": "*i32",
}


@pytest.mark.skipif(_INTERPRETED, reason="compiles for a GPU, not for the interpreter")
@pytest.mark.parametrize("kernel", ["step_kernel", "moments_kernel"])
@pytest.mark.parametrize(("counted", "flag"), [("*i1", False), ("*i64", True)])
def test_the_kernels_compile_for_a_hopper_gpu(kernel: str, counted: str, flag: bool) -> None:
    """Through ptxas to a cubin for sm_90 (H100, H200), which needs no GPU: what Triton's
    interpreter does not check (globals, the types of both branches of an if, ...)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from noisy_temp_server.step import fused_kernels  # noqa: PLC0415

    function = getattr(fused_kernels, kernel)
    names = function.arg_names
    flags = {"HAS_BIAS": flag, "ACCOUNT": not flag, "LOGITS_SCALED": flag, "BLOCK": 4096}
    flags = {name: value for name, value in flags.items() if name in names}
    types = _POINTERS | {"counted_ptr": counted}
    signature = {name: types.get(name, "i32") for name in names if name not in flags}
    signature |= dict.fromkeys(flags, "constexpr")
    constants = {(names.index(name),): value for name, value in flags.items()}
    source = ASTSource(fn=function, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    assert compiled.asm["cubin"]
    assert compiled.metadata.num_warps == 16
