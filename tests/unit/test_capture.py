"""The capture of served logits in the engine (`vllm_plugin.capture`), under both runners'
interfaces, and its way to the API process (`TraceCollector.take_rows`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

from noisy_temp_server.engine_contract import request_args
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, POLICY_FILE_ENV, TRACE_ENDPOINT_ENV
from noisy_temp_server.engine_contract.trace_channel import CapturedRows
from noisy_temp_server.engine_contract.trace_sender import TraceSender
from noisy_temp_server.server.metrics import ApiMetrics
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor
from noisy_temp_server.vllm_plugin.processor_v1 import NoisyTemperatureV1
from noisy_temp_server.vllm_plugin.processor_v2 import NoisyTemperatureV2
from noisy_temp_server.vllm_plugin.runtime_noise import (
    RuntimeLogitNoiseProcessor,
    RuntimeNoiseV1,
    RuntimeNoiseV2,
)

VOCAB = 17
SLOTS = 6
FIXED = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=2.0)
V1_RESCALE_BOUND = 2.0**-23
"""|fl(fl(z/T)·T) - z| <= 2·2⁻²⁴·|z|: two float32 roundings (capture's module docstring)."""


@pytest.fixture
def collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TraceCollector]:
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)
    for name in ("NTS_CAPTURE_ROWS_PER_STEP", "NTS_CAPTURE_POSITIONS", "NTS_CAPTURE_QUEUE_ROWS"):
        monkeypatch.delenv(name, raising=False)
    with TraceCollector(f"ipc://{tmp_path}/trace.sock") as running:
        monkeypatch.setenv(TRACE_ENDPOINT_ENV, running.endpoint)
        yield running


def _captured(trace_id: str, temperature: float = 1.0, **keys: Any) -> SamplingParams:
    extra = {"nts_capture": True, "nts_trace_id": trace_id, **keys}
    return SamplingParams(temperature=temperature, extra_args=extra)


def _v1(**bounds: int) -> NoisyTemperatureV1:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=SLOTS))
    processor = NoisyTemperatureLogitsProcessor(config, torch.device("cpu"), False)
    assert isinstance(processor, NoisyTemperatureV1)
    processor.capture.bounds = dataclasses.replace(processor.capture.bounds, **bounds)
    return processor


def _add_v1(processor: NoisyTemperatureV1, rows: list[tuple[SamplingParams, list[int]]]) -> None:
    added = [(row, params, None, outputs) for row, (params, outputs) in enumerate(rows)]
    processor.update_state(BatchUpdate(len(rows), [], added, []))


def _take(collector: TraceCollector, trace_id: str, n_steps: int) -> CapturedRows:
    rows = collector.take_rows(trace_id, n_steps, timeout=5.0)
    assert rows is not None
    return rows


def test_v1_captures_unscaled_rows_of_marked_requests_tuned_or_not(
    collector: TraceCollector,
) -> None:
    processor = _v1()
    t_request = [0.7, 1.3, 0.9]
    outputs: list[list[int]] = [[], [], []]
    _add_v1(
        processor,
        [
            (_captured("a", t_request[0]), outputs[0]),  # captured, untuned (rule off)
            (_captured("b", t_request[1], nts_policy=FIXED.to_json()), outputs[1]),  # and tuned
            (SamplingParams(temperature=t_request[2]), outputs[2]),  # neither
        ],
    )
    served = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(0)) * 8
    for step in range(2):
        logits = served[step] / torch.tensor(t_request).unsqueeze(1)  # what V1 hands over
        untouched = logits[2].clone()
        processor.apply(logits)
        assert torch.equal(logits[2], untouched)
        torch.testing.assert_close(logits[1], served[step, 1] / t_request[1] / 2.0)  # T* applied
        for row in outputs[:2]:
            row.append(0)  # the engine appends the sampled token
    processor.capture.reporter.flush()  # type: ignore[union-attr]
    for column, trace_id in enumerate("ab"):
        rows = _take(collector, trace_id, 2)
        assert rows.steps.tolist() == [0, 1]
        error = (torch.from_numpy(rows.rows) - served[:, column]).abs()
        assert (error <= V1_RESCALE_BOUND * served[:, column].abs()).all()
    assert collector.take_rows("c", 1, timeout=0.2) is None


def test_v1_rescaling_error_bound() -> None:
    """The float error of multiplying V1's z/T back by T stays within two float32 roundings."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 4096, generator=generator) * 20
    for temperature in (0.01, 0.3, 0.7, 1.0, 1.1, 1.7, 3.0):
        back = (logits / temperature) * temperature
        error = (back - logits).abs()
        assert (error <= V1_RESCALE_BOUND * logits.abs()).all(), temperature
        assert error.max() > 0 or temperature == 1.0  # the bound is not vacuous


def test_no_captured_request_means_no_capture_work(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = _v1()
    calls: list[Any] = []
    monkeypatch.setattr(processor.capture, "_capture", lambda *args: calls.append(args))
    _add_v1(processor, [(SamplingParams(temperature=1.0, extra_args={"nts_trace_id": "x"}), [])])
    processor.apply(torch.randn(1, VOCAB))
    assert processor.capture.active == 0
    assert calls == []
    greedy = SamplingParams(temperature=0.0, extra_args={"nts_capture": True, "nts_trace_id": "g"})
    _add_v1(processor, [(greedy, [])])
    assert processor.capture.active == 0  # greedy requests are never captured


def test_v1_capture_follows_batch_moves(collector: TraceCollector) -> None:
    processor = _v1()
    outputs: list[int] = []
    _add_v1(processor, [(SamplingParams(), []), (_captured("m"), outputs)])
    processor.update_state(BatchUpdate(2, [], [], [(0, 1, MoveDirectionality.SWAP)]))
    logits = torch.randn(2, VOCAB)
    processor.apply(logits.clone())
    processor.capture.reporter.flush()  # type: ignore[union-attr]
    torch.testing.assert_close(torch.from_numpy(_take(collector, "m", 1).rows[0]), logits[0])


def test_rows_per_step_bound_rotates_and_announces_drops(collector: TraceCollector) -> None:
    processor = _v1(rows_per_step=2)
    outputs: list[list[int]] = [[], [], []]
    _add_v1(processor, [(_captured(f"r{i}"), outputs[i]) for i in range(3)])
    for _ in range(3):
        processor.apply(torch.randn(3, VOCAB))
        for row in outputs:
            row.append(0)
    processor.capture.reporter.flush()  # type: ignore[union-attr]
    assert sum(processor.capture.dropped.values()) == 3  # one row per step over the bound
    taken = [_take(collector, f"r{i}", 3) for i in range(3)]
    assert collector.capture_drops()["rows_per_step"] == 3  # counted where the scorer runs
    assert sum(len(rows.steps) for rows in taken) == 6
    assert all(len(rows.steps) == 2 for rows in taken)  # rotation: each request loses one step


def test_positions_bound_stops_at_the_last_step(collector: TraceCollector) -> None:
    processor = _v1(positions=2)
    outputs: list[int] = []
    _add_v1(processor, [(_captured("p"), outputs)])
    for _ in range(4):
        processor.apply(torch.randn(1, VOCAB))
        outputs.append(0)
    processor.capture.reporter.flush()  # type: ignore[union-attr]
    assert _take(collector, "p", 2).steps.tolist() == [0, 1]
    assert collector.held_row_bytes() == 0  # nothing beyond the bound was sent


def test_full_queue_drops_counts_and_never_blocks(collector: TraceCollector) -> None:
    processor = _v1()
    reporter = processor.capture.reporter
    assert reporter is not None
    reporter.capture_queue_rows = 2
    reporter._start = lambda: None  # type: ignore[method-assign]  (no reader: the queue fills)
    outputs: list[int] = []
    _add_v1(processor, [(_captured("q"), outputs)])
    for _ in range(5):
        processor.apply(torch.randn(1, VOCAB))
        outputs.append(0)
    assert reporter.capture_dropped_rows == 3
    reporter.flush()
    rows = _take(collector, "q", 5)  # returns at once: the dropped steps were announced
    assert rows.steps.tolist() == [0, 1]
    assert collector.capture_drops() == {
        "rows_per_step": 0,
        "speculative": 0,
        "queue_full": 3,
        "buffer_full": 0,
    }


def test_a_capture_fault_never_reaches_serving(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = _v1()
    _add_v1(processor, [(_captured("f", nts_policy=FIXED.to_json()), [])])

    def broken(step: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(processor.capture.reporter, "stage_capture", broken)
    logits = torch.ones(1, VOCAB)
    processor.apply(logits)
    torch.testing.assert_close(logits, torch.full((1, VOCAB), 0.5))  # T* still applied


# -- Model Runner V2 ---------------------------------------------------------------------


def _uva(values: list[int]) -> UvaBackedTensor:
    tensor = UvaBackedTensor(len(values), dtype=torch.int32)
    tensor.np[:] = values
    tensor.copy_to_uva()
    return tensor


def _v2(monkeypatch: pytest.MonkeyPatch, prompt: list[int], prefill: list[int]) -> Any:
    if not torch.cuda.is_available():
        monkeypatch.setattr("vllm.v1.worker.gpu.buffer_utils.is_uva_available", lambda: False)
    state = LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=SLOTS,
        vocab_size=VOCAB,
        all_token_ids=None,  # type: ignore[arg-type]
        prompt_len=_uva(prompt),
        prefill_len=_uva(prefill),
        total_len=None,  # type: ignore[arg-type]
    )
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=SLOTS))
    processor = NoisyTemperatureLogitsProcessor(config, state)
    assert isinstance(processor, NoisyTemperatureV2)
    return processor


def _ctx(slots: list[int], seq_lens: list[int], rows: int | None = None) -> LogitsContext:
    expanded = slots if rows is None else [slots[0]] * rows
    return LogitsContext(
        expanded_idx_mapping=torch.tensor(expanded, dtype=torch.int32),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        idx_mapping_np=np.asarray(slots, dtype=np.int32),
        expanded_local_pos=torch.zeros(len(expanded), dtype=torch.int32),
        input_ids=torch.zeros(len(expanded), dtype=torch.int32),
        pos=torch.tensor([s - 1 for s in seq_lens][: len(expanded)], dtype=torch.int64),
        seq_lens_upper_bound_np=np.asarray(seq_lens, dtype=np.int32),
    )


def test_v2_captures_exact_rows_at_host_steps(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = _v2(monkeypatch, prompt=[5] * SLOTS, prefill=[5, 5, 9, 5, 5, 5])
    assert processor.add_request(3, _captured("v", 0.6))  # needs processing: captured
    assert processor.add_request(2, _captured("w", 0.6))  # resumed: prefill 9, prompt 5
    assert not processor.add_request(1, SamplingParams(temperature=0.6))
    processor.apply_staged_writes()
    logits = torch.randn(3, VOCAB)
    expected = logits.clone()
    # slot 3 samples position 7 (step 2); slot 2 is mid-prefill (8 < 9): discarded, not captured
    processor.apply(logits, _ctx([1, 3, 2], [6, 7, 8]))
    assert torch.equal(logits, expected)  # nothing tuned: untouched
    processor.capture.reporter.flush()
    rows = _take(collector, "v", 3)
    assert rows.steps.tolist() == [2]
    assert torch.equal(torch.from_numpy(rows.rows[0]), expected[1])  # exact under V2
    assert collector.take_rows("w", 1, timeout=0.2) is None


def test_v2_speculative_rows_are_not_captured(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = _v2(monkeypatch, prompt=[5] * SLOTS, prefill=[5] * SLOTS)
    processor.add_request(0, _captured("s"))
    processor.apply_staged_writes()
    processor.apply(torch.randn(3, VOCAB), _ctx([0], [8], rows=3))
    assert sum(processor.capture.dropped.values()) == 1
    processor.capture.reporter.flush()  # type: ignore[union-attr]
    deadline = time.monotonic() + 5
    while collector.capture_drops()["speculative"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert collector.capture_drops()["speculative"] == 1  # announced without any row


# -- the API side ------------------------------------------------------------------------


def test_take_rows_waits_for_announced_steps_and_bounds_memory(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/rows.sock"
    row_bytes = VOCAB * 4
    with TraceCollector(endpoint, max_row_bytes=3 * row_bytes) as collector:
        sender = TraceSender(endpoint)
        rows = np.arange(2 * VOCAB, dtype=np.float32).reshape(2, VOCAB)
        sender.send_rows([("a", 0), ("a", 2)], rows, dropped=[("a", 1)])
        taken = _take(collector, "a", 3)
        assert taken.steps.tolist() == [0, 2]
        np.testing.assert_array_equal(taken.rows, rows)
        sender.send_rows([("old", 0), ("old", 1)], rows)
        sender.send_rows([("new", 0), ("new", 1)], rows)  # over the bound: "old" goes
        assert _take(collector, "new", 2).steps.tolist() == [0, 1]
        assert collector.take_rows("old", 2, timeout=0.1) is None
        assert collector.capture_drops()["buffer_full"] == 2
        assert collector.held_row_bytes() == 0
        sender.close()


def test_rows_arriving_after_their_request_was_let_go_are_not_held(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/late.sock"
    with TraceCollector(endpoint) as collector:
        sender = TraceSender(endpoint)
        rows = np.ones((1, VOCAB), dtype=np.float32)
        collector.drop_rows("cancelled")  # e.g. the request was cancelled mid-generation
        assert collector.take_rows("timed-out", 1, timeout=0.05) is None
        sender.send_rows([("cancelled", 0)], rows)
        sender.send_rows([("timed-out", 0)], rows)
        sender.send_rows([("live", 0)], rows)
        assert _take(collector, "live", 1).steps.tolist() == [0]  # all three have arrived
        assert collector.held_row_bytes() == 0
        sender.close()


def test_drop_counts_of_several_engines_add_up(tmp_path: Path) -> None:
    """Data-parallel engines each report their own cumulative drop counts: the collector's
    totals (and what it reports growing) are the sum over engines, not the last report."""
    endpoint = f"ipc://{tmp_path}/drops.sock"
    grown: list[tuple[str, int]] = []
    no_rows = np.zeros((0, VOCAB), dtype=np.float32)
    with TraceCollector(endpoint, on_rows_dropped=lambda r, n: grown.append((r, n))) as collector:
        first, second = TraceSender(endpoint), TraceSender(endpoint)
        first.send_rows([], no_rows, drop_counts={"queue_full": 3, "speculative": 1})
        second.send_rows([], no_rows, drop_counts={"queue_full": 2})
        first.send_rows([], no_rows, drop_counts={"queue_full": 5, "speculative": 1})
        deadline = time.monotonic() + 5
        while collector.capture_drops()["queue_full"] < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.capture_drops() == {
            "rows_per_step": 0,
            "speculative": 1,
            "queue_full": 7,
            "buffer_full": 0,
        }
        assert sorted(grown) == [
            ("queue_full", 2),
            ("queue_full", 2),
            ("queue_full", 3),
            ("speculative", 1),
        ]
        first.close()
        second.close()


def test_v2_runs_the_runtime_noise_before_the_capture_and_t_star(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's V2 loader builds (and runs) entry points first: the T* processor, then the
    runtime-noise processor named by class path. The noise must still come first."""
    monkeypatch.setenv("NTS_RUNTIME_NOISE_SIGMA", "2.0")
    tuner = _v2(monkeypatch, prompt=[5] * SLOTS, prefill=[5] * SLOTS)
    noise = RuntimeLogitNoiseProcessor(tuner._vllm_config, tuner._req_states)
    assert isinstance(noise, RuntimeNoiseV2)
    assert noise.handed_over
    params = _captured("n", nts_policy=FIXED.to_json())
    for processor in (tuner, noise):
        assert processor.add_request(0, params)
        processor.apply_staged_writes()
    clean = torch.zeros(1, 4096)
    logits = clean.clone()
    for processor in (tuner, noise):  # vLLM's order
        logits = processor.apply(logits, _ctx([0], [7]))
    tuner.capture.reporter.flush()
    captured = torch.from_numpy(_take(collector, "n", 3).rows[0])
    assert float(captured.std()) == pytest.approx(2.0, rel=0.1)  # the capture saw the noise
    torch.testing.assert_close(logits[0], captured / 2.0)  # and T* divided it, noise included


def test_v1_with_a_bias_directory_runs_the_runtime_noise_before_the_capture_and_t_star(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With a bias directory the V1 T* processor is not argmax-invariant: it runs among the
    processors before the temperature, entry points (it) before class paths (the noise)."""
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("NTS_RUNTIME_NOISE_SIGMA", "2.0")
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=SLOTS),
        model_config=SimpleNamespace(get_vocab_size=lambda: 4096),
    )
    tuner = NoisyTemperatureLogitsProcessor(config, torch.device("cpu"), False)
    noise = RuntimeLogitNoiseProcessor(config, torch.device("cpu"), False)
    assert isinstance(tuner, NoisyTemperatureV1)
    assert isinstance(noise, RuntimeNoiseV1)
    assert not tuner.is_argmax_invariant()
    assert noise.handed_over
    params = _captured("b", 0.5, nts_policy=FIXED.to_json())
    update = BatchUpdate(1, [], [(0, params, None, [])], [])
    for processor in (tuner, noise):
        processor.update_state(update)
    logits = torch.zeros(1, 4096)  # unscaled: these processors run before the temperature
    for processor in (tuner, noise):  # vLLM's order
        logits = processor.apply(logits)
    tuner.capture.reporter.flush()  # type: ignore[union-attr]
    captured = torch.from_numpy(_take(collector, "b", 1).rows[0])
    assert float(captured.std()) == pytest.approx(2.0, rel=0.1)
    torch.testing.assert_close(logits[0], captured / 2.0)


def test_drop_counts_reach_the_status_and_a_metric_with_bounded_labels(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/drops.sock"
    registry = CollectorRegistry()
    metrics = ApiMetrics(registry)
    row_bytes = VOCAB * 4

    def count(reason: str, n: int) -> None:
        metrics.capture_dropped_rows.labels(reason).inc(n)

    def value(reason: str) -> float | None:
        return registry.get_sample_value("nts_capture_dropped_rows_total", {"reason": reason})

    with TraceCollector(endpoint, max_row_bytes=2 * row_bytes, on_rows_dropped=count) as collector:
        sender = TraceSender(endpoint)
        rows = np.ones((1, VOCAB), dtype=np.float32)
        sender.send_rows([("a", 0)], rows, drop_counts={"rows_per_step": 2, "made_up": 9})
        sender.send_rows([("a", 1)], rows, drop_counts={"rows_per_step": 5, "queue_full": 1})
        sender.send_rows([("b", 0)], rows, drop_counts={"rows_per_step": 4})  # an older count
        _take(collector, "b", 1)  # every message is in: "a" was evicted for "b"
        sender.close()
        drops = collector.capture_drops()
    assert drops == {"rows_per_step": 5, "speculative": 0, "queue_full": 1, "buffer_full": 2}
    assert {reason: value(reason) for reason in drops} == drops
    assert value("made_up") is None


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The calls of the request keys' parser from now on (it still parses)."""
    parses: list[object] = []
    parse = request_args.parse_request_args

    def counting(extra_args: Any) -> request_args.TuningKeys:
        parses.append(extra_args)
        return parse(extra_args)

    monkeypatch.setattr(request_args, "parse_request_args", counting)
    return parses


def test_the_engine_reads_a_request_s_keys_once_for_tuning_and_capture(
    collector: TraceCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = _v1()
    v2 = _v2(monkeypatch, prompt=[5] * SLOTS, prefill=[5] * SLOTS)
    parses = _count_parses(monkeypatch)
    _add_v1(v1, [(_captured("one", 0.8, nts_policy=FIXED.to_json()), [])])
    assert (v1.capture.active, v1.tuning.host_tuned.sum(), len(parses)) == (1, 1, 1)
    assert v2.add_request(0, _captured("two", 0.8, nts_policy=FIXED.to_json()))
    assert (v2.capture.active, v2.tuning.host_tuned.sum(), len(parses)) == (1, 1, 2)
