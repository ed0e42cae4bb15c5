"""The T* processor under Model Runner V2, against vLLM's real V2 interface objects."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, _load_logitsprocs_by_fqcns
from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcRequestState,
)
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsProcessor as V2LogitsProcessor,
)
from vllm.v1.worker.gpu.sample.logits_processor.loader import (
    _load_v2_logitsprocs_by_fqcns,
    _load_v2_logitsprocs_plugins,
    build_custom_logits_processors_params_validator,
)

from noisy_temp_server.engine_contract.keys import POLICY_FILE_ENV, TRACE_ENDPOINT_ENV
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.step.engine_metrics import MAX_LABELS, OVERFLOW_STEP_BUCKET
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature, step_temperatures
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.temperature.stats import served_row_features
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor
from noisy_temp_server.vllm_plugin.processor_v2 import NoisyTemperatureV2

VOCAB = 13
SLOTS = 6
LINEAR = TemperaturePolicy(
    rule=Rule.LINEAR, step_edges=(0, 3), alpha_by_step=(0.5, 0.25), sigma2_by_step=(0.0, 0.0)
)
FISHER = TemperaturePolicy(
    rule=Rule.FISHER, step_edges=(0,), alpha_by_step=(0.0,), sigma2_by_step=(0.8,)
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENDPOINT_ENV, raising=False)
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)
    if not torch.cuda.is_available():
        # vLLM's buffers believe in UVA on CPU but cannot pin memory there: use their
        # explicit-copy fallback (the same class vLLM uses without pinned memory).
        monkeypatch.setattr("vllm.v1.worker.gpu.buffer_utils.is_uva_available", lambda: False)


def _uva(values: list[int]) -> UvaBackedTensor:
    tensor = UvaBackedTensor(len(values), dtype=torch.int32)
    tensor.np[:] = values
    tensor.copy_to_uva()
    return tensor


class _Batch:
    """Real `LogitsProcRequestState` buffers for SLOTS slots with given prompt lengths."""

    def __init__(self, prompt_len: list[int]) -> None:
        self.prompt = _uva(prompt_len)
        self.prefill = _uva(prompt_len)
        self.state = LogitsProcRequestState(
            device=torch.device("cpu"),
            max_num_reqs=SLOTS,
            vocab_size=VOCAB,
            all_token_ids=None,  # type: ignore[arg-type]  (not read by the processor)
            prompt_len=self.prompt,
            prefill_len=self.prefill,
            total_len=None,  # type: ignore[arg-type]
        )

    def set_slot(self, slot: int, prompt_len: int, prefill_len: int | None = None) -> None:
        self.prompt.np[slot] = prompt_len
        self.prefill.np[slot] = prompt_len if prefill_len is None else prefill_len
        self.prompt.copy_to_uva()
        self.prefill.copy_to_uva()


def _ctx(rows: list[tuple[int, int]]) -> LogitsContext:
    """One step: (slot, position of the row's input token) per logits row."""
    slots = [slot for slot, _ in rows]
    requests = list(dict.fromkeys(slots))
    return LogitsContext(
        expanded_idx_mapping=torch.tensor(slots, dtype=torch.int32),
        idx_mapping=torch.tensor(requests, dtype=torch.int32),
        idx_mapping_np=np.asarray(requests, dtype=np.int32),
        expanded_local_pos=torch.zeros(len(rows), dtype=torch.int32),
        input_ids=torch.zeros(len(rows), dtype=torch.int32),
        pos=torch.tensor([pos for _, pos in rows], dtype=torch.int64),
        seq_lens_upper_bound_np=np.zeros(len(requests), dtype=np.int32),
    )


def _processor(batch: _Batch, registry: CollectorRegistry) -> NoisyTemperatureV2:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=SLOTS))
    processor = NoisyTemperatureLogitsProcessor(config, batch.state, registry=registry)
    assert isinstance(processor, NoisyTemperatureV2)
    return processor


def _params(temperature: float = 1.0, **keys: Any) -> SamplingParams:
    return SamplingParams(temperature=temperature, extra_args=keys or None)


def _reference(policy: TemperaturePolicy, steps: list[int]) -> torch.Tensor:
    return policy_temperature(policy, torch.tensor(steps))


def test_rows_map_to_slots_and_steps_follow_positions() -> None:
    batch = _Batch([4] * SLOTS)
    processor = _processor(batch, CollectorRegistry())
    assert processor.add_request(2, _params(nts_policy=LINEAR.to_json()))
    assert not processor.add_request(5, _params())  # untuned (rule off)
    processor.apply_staged_writes()
    # slot 2 has three rows (speculative decoding: positions 4, 5, 6 -> steps 1, 2, 3),
    # slot 5 one row.
    ctx = _ctx([(5, 7), (2, 4), (2, 5), (2, 6)])
    logits = torch.randn(4, VOCAB)
    expected = logits.clone()
    expected[1:] /= _reference(LINEAR, [1, 2, 3]).unsqueeze(1)
    out = processor.apply(logits, ctx)
    assert out is logits
    assert torch.equal(logits[0], expected[0])  # untuned row bitwise untouched
    torch.testing.assert_close(logits, expected)


def test_steps_follow_the_lengths_of_each_occupancy() -> None:
    """The lengths vLLM sets at admission hold for the occupancy: a resumed request
    (prefill_len > prompt_len) continues at its step and is counted from its prefill's end
    on, and the slot's next occupant starts from its own prompt."""
    batch = _Batch([1] * SLOTS)
    processor = _processor(batch, CollectorRegistry())
    batch.set_slot(1, prompt_len=4, prefill_len=7)  # 3 tokens produced before preemption
    processor.add_request(1, _params(nts_policy=LINEAR.to_json()))
    processor.apply_staged_writes()
    for position, step in ((5, 2), (6, 3), (7, 4)):  # a prefill chunk, then steps 3 and 4
        logits = torch.ones(1, VOCAB)
        processor.apply(logits, _ctx([(1, position)]))
        torch.testing.assert_close(logits[0], 1 / _reference(LINEAR, [step]).expand(VOCAB))
    assert processor.tuning.summaries()[1, 1] == 2
    batch.set_slot(1, prompt_len=2)
    processor.add_request(1, _params(nts_policy=LINEAR.to_json()))
    processor.apply_staged_writes()
    logits = torch.ones(2, VOCAB)
    processor.apply(logits, _ctx([(1, 1), (1, 4)]))  # steps 0 and 3
    torch.testing.assert_close(logits[:, 0], 1 / _reference(LINEAR, [0, 3]))
    assert processor.tuning.summaries()[1, 1] == 2


def test_bad_rows_count_for_tuned_requests_only() -> None:
    """Beside an untuned or bias-less untuned request, its bad rows are not counted; once every
    slot holds a tuned request, all are."""
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    processor.add_request(0, _params(nts_rule="fixed", nts_t=2.0))
    processor.add_request(1, _params(nts_tune=False))
    processor.apply_staged_writes()
    bad = torch.full((2, VOCAB), float("nan"))
    processor.apply(bad.clone(), _ctx([(0, 0), (1, 0)]))
    processor.tuning.reporter.flush()
    assert processor.bad_rows == 1
    processor.add_request(1, _params(nts_rule="fixed", nts_t=3.0))
    processor.apply_staged_writes()
    processor.apply(bad.clone(), _ctx([(0, 1), (1, 0)]))
    processor.tuning.reporter.flush()
    assert processor.bad_rows == 3


def test_a_step_without_untuned_rows_takes_the_all_tuned_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM frees a slot without telling processors: once an untuned request is gone from the
    step's slots (finished, or its slot re-admitted with a tuned request), steps take the
    all-tuned path again (no per-row tuned mask) and its bad rows still count for tuned
    requests only while it runs."""
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    paths: list[bool] = []
    tune = processor.tuning.tune

    def spy(*args: Any, all_rows_tuned: bool = False, **kwargs: Any) -> None:
        paths.append(all_rows_tuned)
        tune(*args, all_rows_tuned=all_rows_tuned, **kwargs)

    monkeypatch.setattr(processor.tuning, "tune", spy)
    processor.add_request(0, _params(nts_rule="fixed", nts_t=2.0))
    processor.add_request(1, _params(nts_tune=False))
    processor.apply_staged_writes()
    bad = torch.full((2, VOCAB), float("nan"))
    processor.apply(bad.clone(), _ctx([(0, 0), (1, 0)]))
    processor.apply(bad[:1].clone(), _ctx([(0, 1)]))  # slot 1's request finished
    processor.tuning.reporter.flush()
    assert paths == [False, True]
    assert processor.bad_rows == 2  # slot 0's two rows, never slot 1's
    processor.add_request(1, _params(nts_rule="fixed", nts_t=3.0))
    processor.apply_staged_writes()
    processor.apply(bad.clone(), _ctx([(0, 2), (1, 0)]))
    processor.tuning.reporter.flush()
    assert paths == [False, True, True]
    assert processor.bad_rows == 4


def test_recycled_slot_takes_the_new_occupant_state() -> None:
    batch = _Batch([2] * SLOTS)
    registry = CollectorRegistry()
    processor = _processor(batch, registry)
    processor.add_request(0, _params(nts_rule="fixed", nts_t=2.0))
    processor.apply_staged_writes()
    logits = torch.ones(1, VOCAB)
    processor.apply(logits, _ctx([(0, 1)]))
    assert torch.allclose(logits, torch.full_like(logits, 0.5))
    # The request finished; vLLM gives slot 0 to an untuned request, then to a tuned one.
    assert not processor.add_request(0, _params(nts_tune=False))
    processor.apply_staged_writes()
    logits = torch.ones(1, VOCAB)
    processor.apply(logits, _ctx([(0, 1)]))
    assert torch.equal(logits, torch.ones(1, VOCAB))
    processor.add_request(0, _params(nts_rule="fixed", nts_t=4.0))
    processor.apply_staged_writes()
    logits = torch.ones(1, VOCAB)
    processor.apply(logits, _ctx([(0, 1)]))
    assert torch.allclose(logits, torch.full_like(logits, 0.25))
    summary = processor.tuning.summaries()[0].tolist()
    assert summary == [4.0, 1.0, 4.0, 4.0]  # only the new occupant's step


def test_greedy_requests_are_never_tuned() -> None:
    processor = _processor(_Batch([2] * SLOTS), CollectorRegistry())
    assert not processor.add_request(1, _params(temperature=0.0, nts_rule="fixed", nts_t=2.0))


def test_chunked_prefill_rows_are_tuned_but_not_counted() -> None:
    batch = _Batch([8] * SLOTS)
    processor = _processor(batch, CollectorRegistry())
    processor.add_request(3, _params(nts_rule="fixed", nts_t=2.0))
    processor.apply_staged_writes()
    processor.apply(torch.ones(1, VOCAB), _ctx([(3, 3)]))  # prefill chunk ends at position 3
    assert processor.tuning.summaries()[3, 1] == 0
    processor.apply(torch.ones(1, VOCAB), _ctx([(3, 7)]))  # last prompt token: step 0
    assert processor.tuning.summaries()[3, 1] == 1


def test_fisher_takes_the_variance_under_the_request_temperature() -> None:
    """V2 sees unscaled logits; Var is taken under softmax(z / T_req), in units of z."""
    batch = _Batch([1] * SLOTS)
    processor = _processor(batch, CollectorRegistry())
    processor.add_request(0, _params(temperature=0.5, nts_policy=FISHER.to_json()))
    processor.apply_staged_writes()
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    served = logits.clone()
    processor.apply(logits, _ctx([(0, 0)]))
    var = served_row_features(served / 0.5).var_q * 0.5**2
    expected_t = (1 + 0.8 / var.clamp(min=FISHER.fisher_var_floor)).clamp(
        FISHER.bounds.t_min, FISHER.bounds.t_max
    )
    torch.testing.assert_close(logits, served / expected_t.unsqueeze(1))


def test_v1_and_v2_apply_the_same_effective_temperature() -> None:
    """V1 divides logits already divided by T_req; V2 divides unscaled logits before vLLM
    divides by T_req: the sampled distributions agree."""
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=SLOTS))
    v1 = NoisyTemperatureLogitsProcessor(
        config, torch.device("cpu"), False, registry=CollectorRegistry()
    )
    v2 = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    params = _params(temperature=0.7, nts_policy=FISHER.to_json())
    v1.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, None, [])], moved=[]))
    v2.add_request(0, params)
    v2.apply_staged_writes()
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    out_v1 = v1.apply(logits / 0.7)
    out_v2 = v2.apply(logits.clone(), _ctx([(0, 0)])) / 0.7
    torch.testing.assert_close(out_v1, out_v2)


def test_both_loaders_accept_the_entry_point() -> None:
    target = "noisy_temp_server.vllm_plugin.processor:NoisyTemperatureLogitsProcessor"
    (loaded,) = _load_v2_logitsprocs_by_fqcns([target])
    assert issubclass(loaded, V2LogitsProcessor)
    validate = build_custom_logits_processors_params_validator([target])
    validate(_params(nts_rule="sqrt"))
    with pytest.raises(VLLMValidationError, match="nts_rule"):
        validate(_params(nts_rule="nope"))
    assert _load_logitsprocs_by_fqcns([target]) == [NoisyTemperatureLogitsProcessor]


def test_installed_entry_point_passes_the_v2_plugin_loader() -> None:
    assert NoisyTemperatureLogitsProcessor in _load_v2_logitsprocs_plugins()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_does_not_synchronise_on_cuda() -> None:
    batch = _Batch([2] * SLOTS)
    batch.state = LogitsProcRequestState(**{**batch.state.__dict__, "device": torch.device("cuda")})
    processor = _processor(batch, CollectorRegistry())
    processor.add_request(0, _params(nts_policy=LINEAR.to_json(), nts_trace_id="a", nts_trace=True))
    processor.add_request(1, _params(nts_policy=FISHER.to_json()))
    processor.apply_staged_writes()
    ctx = _ctx([(0, 2), (1, 3)])
    ctx = LogitsContext(
        **{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in ctx.__dict__.items()}
    )
    logits = torch.randn(2, VOCAB, device="cuda")
    processor.apply(logits, ctx)  # warm-up (allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        processor.apply(logits, ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")


SCHEDULE = TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=2.0, schedule_beta=0.3)


def test_schedule_rows_follow_the_closed_form_next_to_table_rows() -> None:
    batch = _Batch([1] * SLOTS)
    processor = _processor(batch, CollectorRegistry())
    processor.add_request(0, _params(nts_policy=SCHEDULE.to_json(), nts_t_max=1.8))
    processor.add_request(1, _params(nts_policy=LINEAR.to_json()))
    processor.add_request(2, _params(nts_tune=False))
    processor.apply_staged_writes()
    for position in (0, 3, 40):
        logits = torch.randn(3, VOCAB)
        expected = logits.clone()
        step = position + 1 - 1
        schedule = SCHEDULE.with_overrides(t_max=1.8)
        expected[0] /= _reference(schedule, [step])
        expected[1] /= _reference(LINEAR, [step])
        processor.apply(logits, _ctx([(0, position), (1, position), (2, position)]))
        torch.testing.assert_close(logits, expected)
        assert torch.equal(logits[2], expected[2])


def test_schedule_without_decay_keeps_the_request_bounds_alone_in_the_batch() -> None:
    """beta = 0: T* is the schedule's t_max clamped to the request's bounds, whoever else is in
    the batch."""
    constant = TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=2.0, schedule_beta=0.0)
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    processor.add_request(0, _params(nts_policy=constant.to_json(), nts_t_max=1.5))
    processor.apply_staged_writes()
    logits = torch.ones(1, VOCAB)
    processor.apply(logits, _ctx([(0, 3)]))
    torch.testing.assert_close(logits, torch.full_like(logits, 1 / 1.5))
    processor.add_request(1, _params(nts_policy=SCHEDULE.to_json()))  # a decaying neighbour
    processor.apply_staged_writes()
    logits = torch.ones(2, VOCAB)
    processor.apply(logits, _ctx([(0, 4), (1, 4)]))
    torch.testing.assert_close(logits[0], torch.full((VOCAB,), 1 / 1.5))


def test_step_only_rules_divide_bad_rows_like_any_other() -> None:
    """T* is finite and > 0 by construction: NaN stays NaN, ±inf stays ±inf, nothing new; the
    bad rows are counted."""
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    processor.add_request(0, _params(nts_rule="fixed", nts_t=2.0))
    processor.apply_staged_writes()
    logits = torch.tensor([[float("nan"), float("inf"), -float("inf")] + [4.0] * (VOCAB - 3)])
    processor.apply(logits, _ctx([(0, 0)]))
    assert logits[0, 0].isnan()
    assert logits[0, 1:3].tolist() == [float("inf"), -float("inf")]
    assert torch.equal(logits[0, 3:], torch.full((VOCAB - 3,), 2.0))
    masked = torch.full((1, VOCAB), -float("inf"))
    processor.apply(masked, _ctx([(0, 1)]))
    processor.apply(torch.ones(1, VOCAB), _ctx([(0, 2)]))  # a good row
    processor.tuning.reporter.flush()
    assert processor.bad_rows == 2  # counted, as under rules that read the row


def _summary_parts(collector: TraceCollector, trace_id: str, steps: int) -> tuple[int, float]:
    report = asyncio.run(collector.wait_for(trace_id, steps, timeout=5.0))
    return report.steps, report.t_mean


def test_a_recycled_slot_reports_its_previous_occupant_to_the_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reporter may not have read the last steps of a finished request before its slot is
    reset for the next one: the state before the reset is kept and delivered."""
    endpoint = f"ipc://{tmp_path}/trace.sock"
    with TraceCollector(endpoint) as collector:
        monkeypatch.setenv(TRACE_ENDPOINT_ENV, endpoint)
        processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
        processor.tuning.reporter.interval_s = 3600.0  # no report unless flushed
        processor.add_request(0, _params(nts_rule="fixed", nts_t=2.0, nts_trace_id="old"))
        processor.apply_staged_writes()
        for position in range(3):
            processor.apply(torch.ones(1, VOCAB), _ctx([(0, position)]))
        processor.add_request(0, _params(nts_rule="fixed", nts_t=4.0, nts_trace_id="new"))
        processor.apply_staged_writes()
        processor.apply(torch.ones(1, VOCAB), _ctx([(0, 0)]))
        processor.tuning.reporter.flush()
        assert _summary_parts(collector, "old", 3) == (3, 2.0)
        assert _summary_parts(collector, "new", 1) == (1, 4.0)


def test_policies_with_more_step_buckets_grow_the_tables_without_losing_counts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    edges = tuple(range(0, 40, 2))  # 20 step buckets: more than the tables start with
    fine = TemperaturePolicy(
        rule=Rule.SQRT,
        step_edges=edges,
        alpha_by_step=tuple(0.1 * i for i in range(len(edges))),
        sigma2_by_step=(0.0,) * len(edges),
    )
    endpoint = f"ipc://{tmp_path}/trace.sock"
    with TraceCollector(endpoint) as collector:
        monkeypatch.setenv(TRACE_ENDPOINT_ENV, endpoint)
        registry = CollectorRegistry()
        processor = _processor(_Batch([1] * SLOTS), registry)
        processor.add_request(0, _params(nts_policy=LINEAR.to_json(), nts_trace_id="coarse"))
        processor.apply_staged_writes()
        for position in range(2):
            processor.apply(torch.randn(1, VOCAB), _ctx([(0, position)]))
        processor.add_request(1, _params(nts_policy=fine.to_json(), nts_trace_id="fine"))
        processor.apply_staged_writes()
        for position in range(2, 12):
            logits = torch.randn(2, VOCAB)
            expected = logits / torch.cat(
                [_reference(LINEAR, [position]), _reference(fine, [position - 2])]
            ).unsqueeze(1)
            processor.apply(logits, _ctx([(0, position), (1, position - 2)]))
            torch.testing.assert_close(logits, expected)
        processor.tuning.reporter.flush()
        steps, mean = _summary_parts(collector, "coarse", 12)
        assert steps == 12
        assert mean == pytest.approx(_reference(LINEAR, list(range(12))).mean().item())
        steps, mean = _summary_parts(collector, "fine", 10)
        assert steps == 10
        assert mean == pytest.approx(_reference(fine, list(range(10))).mean().item())
    count = registry.get_sample_value(
        "nts_step_temperature_count", {"step_bucket": "8-9", "rule": "sqrt"}
    )
    assert count == 2


def test_bad_rows_carry_over_when_the_tables_grow() -> None:
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    processor.tuning.reporter.interval_s = 3600.0  # no report unless flushed
    processor.add_request(0, _params(nts_policy=FISHER.to_json()))
    processor.apply_staged_writes()
    processor.apply(torch.full((1, VOCAB), float("nan")), _ctx([(0, 0)]))
    processor.tuning.reporter.flush()
    assert processor.bad_rows == 1
    edges = tuple(range(0, 40, 2))  # more step buckets than the tables start with
    fine = TemperaturePolicy(
        rule=Rule.SQRT,
        step_edges=edges,
        alpha_by_step=(0.1,) * len(edges),
        sigma2_by_step=(0.0,) * len(edges),
    )
    processor.add_request(1, _params(nts_policy=fine.to_json()))
    processor.apply_staged_writes()
    processor.apply(torch.zeros(2, VOCAB), _ctx([(0, 1), (1, 0)]))
    processor.tuning.reporter.flush()
    assert processor.bad_rows == 1
    processor.apply(torch.full((1, VOCAB), float("nan")), _ctx([(0, 2)]))
    processor.tuning.reporter.flush()
    assert processor.bad_rows == 2


def test_histogram_labels_are_capped_with_a_shared_overflow_label() -> None:
    registry = CollectorRegistry()
    processor = _processor(_Batch([1] * SLOTS), registry)
    processor.tuning.reporter.interval_s = 3600.0  # no report unless flushed
    for first in range(MAX_LABELS + 10):  # one new "<first>+" label per request
        policy = TemperaturePolicy(
            rule=Rule.FIXED,
            step_edges=(0, first + 1),
            alpha_by_step=(0.0, 0.0),
            sigma2_by_step=(0.0, 0.0),
            fixed_temperature=2.0,
        )
        processor.add_request(0, _params(nts_policy=policy.to_json()))
        processor.apply_staged_writes()
        processor.apply(torch.ones(1, VOCAB), _ctx([(0, first + 1)]))
    processor.tuning.reporter.flush()
    labels = {
        sample.labels["step_bucket"]
        for metric in registry.collect()
        if metric.name == "nts_step_temperature"
        for sample in metric.samples
    }
    assert len(labels) <= MAX_LABELS + 1
    assert (
        registry.get_sample_value(
            "nts_step_temperature_count", {"step_bucket": OVERFLOW_STEP_BUCKET, "rule": "fixed"}
        )
        >= 10
    )


def test_admission_evaluates_a_policy_once_per_bounds_and_band(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests differ in trace id and temperature; the step table depends only on the policy,
    the fixed T and bounds and the calibrated table's request-temperature band."""
    evaluated: list[float] = []

    def counted(policy: TemperaturePolicy, request_temperature: float, **bounds: Any) -> Any:
        evaluated.append(request_temperature)
        return step_temperatures(policy, request_temperature, **bounds)

    monkeypatch.setattr("noisy_temp_server.step.slot_tables.step_temperatures", counted)
    table = CalibratedTable(
        step_edges=(0,), temperatures=(((1.25,),), ((0.75,),)), request_temperature_edges=(0, 0.9)
    )
    banded = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table, fixed_temperature=1.0625)
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    for slot, (temperature, trace_id) in enumerate(
        [(0.7, "a"), (0.8, "b"), (1.0, "c"), (1.2, "d")]
    ):
        processor.add_request(
            slot, _params(temperature, nts_policy=banded.to_json(), nts_trace_id=trace_id)
        )
    processor.apply_staged_writes()
    assert evaluated == [0.7, 1.0]  # one evaluation per band
    logits = torch.ones(4, VOCAB)
    processor.apply(logits, _ctx([(slot, 0) for slot in range(4)]))
    torch.testing.assert_close(logits[:, 0], torch.tensor([0.8, 0.8, 4 / 3, 4 / 3]))
    processor.add_request(4, _params(0.7, nts_policy=banded.to_json(), nts_t_max=1.2))
    processor.apply_staged_writes()
    assert evaluated == [0.7, 1.0, 0.7]  # other bounds, another table


def test_tables_shrink_back_when_the_wide_slot_is_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    edges = tuple(range(64))
    wide = TemperaturePolicy(
        rule=Rule.SQRT, step_edges=edges, alpha_by_step=(0.2,) * 64, sigma2_by_step=(0.0,) * 64
    )
    endpoint = f"ipc://{tmp_path}/trace.sock"
    with TraceCollector(endpoint) as collector:
        monkeypatch.setenv(TRACE_ENDPOINT_ENV, endpoint)
        processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
        processor.add_request(0, _params(nts_policy=LINEAR.to_json(), nts_trace_id="stays"))
        processor.add_request(1, _params(nts_policy=wide.to_json()))
        processor.apply_staged_writes()
        assert processor.tuning.layout.columns == 64
        processor.apply(torch.ones(2, VOCAB), _ctx([(0, 0), (1, 0)]))
        processor.add_request(1, _params(nts_rule="fixed", nts_t=2.0))  # the wide one left
        processor.apply_staged_writes()
        assert processor.tuning.layout.columns == 8
        logits = torch.ones(2, VOCAB)
        processor.apply(logits, _ctx([(0, 5), (1, 0)]))
        torch.testing.assert_close(
            logits[:, 0], torch.cat([1 / _reference(LINEAR, [5]), torch.tensor([0.5])])
        )
        processor.tuning.reporter.flush()
        steps, mean = _summary_parts(collector, "stays", 2)
        assert steps == 2
        assert mean == pytest.approx(_reference(LINEAR, [0, 5]).mean().item())


def test_summary_extrema_cover_only_the_step_buckets_a_request_reached() -> None:
    """Constant-T* cells hold their T* from admission; the summaries count them only once
    reached, beside a schedule row (whose extrema the step loop accumulates), after the tables
    grow and when the slot is reused."""
    processor = _processor(_Batch([1] * SLOTS), CollectorRegistry())
    processor.add_request(0, _params(nts_policy=LINEAR.to_json()))
    processor.apply_staged_writes()
    first, later = _reference(LINEAR, [0, 3]).tolist()  # buckets [0, 3) and [3, ...)
    processor.apply(torch.randn(1, VOCAB), _ctx([(0, 0)]))
    assert processor.tuning.summaries()[0, 2:].tolist() == pytest.approx([first, first])
    processor.add_request(1, _params(nts_policy=SCHEDULE.to_json()))
    wide = TemperaturePolicy(
        rule=Rule.SQRT,
        step_edges=tuple(range(0, 40, 2)),
        alpha_by_step=(0.1,) * 20,
        sigma2_by_step=(0.0,) * 20,
    )
    processor.add_request(2, _params(nts_policy=wide.to_json()))  # the tables grow
    processor.apply_staged_writes()
    processor.apply(torch.randn(3, VOCAB), _ctx([(0, 1), (1, 0), (2, 0)]))
    assert processor.tuning.summaries()[0, 2:].tolist() == pytest.approx([first, first])
    processor.apply(torch.randn(3, VOCAB), _ctx([(0, 3), (1, 1), (2, 1)]))
    assert processor.tuning.summaries()[0, 2:].tolist() == pytest.approx([later, first])
    wide_t = _reference(wide, [0]).item()
    assert processor.tuning.summaries()[2, 1:].tolist() == pytest.approx([2, wide_t, wide_t])
    processor.add_request(0, _params(nts_rule="fixed", nts_t=2.0))  # reused by a new request
    processor.apply_staged_writes()
    assert processor.tuning.summaries()[0, 1] == 0
    processor.apply(torch.randn(1, VOCAB), _ctx([(0, 5)]))
    assert processor.tuning.summaries()[0].tolist() == [2.0, 1.0, 2.0, 2.0]
