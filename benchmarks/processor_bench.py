"""Host time per step of the T* processor's ``apply()``, under both runners' classes.

For each (runner class, rule, batch, vocabulary): a processor is built as vLLM builds it (the V1
class from ``(vllm_config, device, is_pin_memory)``, the V2 class from a real
``LogitsProcRequestState``), every row is a tuned request with a trace id (summaries and the
``nts_step_temperature`` histogram reported as our server runs them, by the reporter thread,
to a live trace collector; runner ``v2-freed``: the V2 class after an untuned (greedy) request
finished in one more slot, which vLLM frees without telling processors, as on a server after any
greedy request), then ``apply()`` is timed over ``--steps`` steps (after warm-up),
each on fresh logits and under ``torch.inference_mode`` (as vLLM's model runners call the
sampler).

Reported per configuration: the median wall time of one ``apply()`` and of the bare division
``logits.div_(t)`` it contains, and their difference, the processor's *overhead*. On the CPU
(this script's default device) the time is all host time and includes the arithmetic; the
overhead at a small vocabulary is the host work per step that a GPU would otherwise wait for
(target: ≤ 0.1 ms at batch 256 for step-only rules). Rules: ``sqrt`` (a table lookup, as off,
fixed, linear and a step-only calibrated table), ``schedule`` (the lookup plus its closed-form
factor), ``fisher`` (reads the served row: one softmax pass), ``calibrated-entropy`` (a
calibrated table over step and served-entropy buckets: reads the row too) and ``sqrt+bias``
(``sqrt`` with a per-token logit bias in every row's policy: the processor adds it before the
division, a gather of the rows' bias and an add; its bare arithmetic also counts one add of a
[V] vector, so its overhead is apply - divide - add). Each configuration is measured
``--rounds`` times, the rounds spread over the run; the table shows the least disturbed round (on
a shared machine, the cost without interference) and the median over the rounds. Saved as JSON
+ markdown under ``benchmarks/results/``.

    PYTHONPATH=. .venv/bin/python benchmarks/processor_bench.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

from noisy_temp_server.correction.files import bias_sha256, save_bias_file
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, TRACE_ENDPOINT_ENV
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor

RESULTS = Path(__file__).parent / "results"
_EDGES = (0, 8, 32, 128, 512)
POLICIES = {
    "sqrt": TemperaturePolicy(
        rule=Rule.SQRT,
        step_edges=_EDGES,
        alpha_by_step=(0.3, 0.2, 0.1, 0.05, 0.02),
        sigma2_by_step=(0.0,) * 5,
    ),
    "schedule": TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=1.5, schedule_beta=0.05),
    "fisher": TemperaturePolicy(
        rule=Rule.FISHER,
        step_edges=_EDGES,
        alpha_by_step=(0.0,) * 5,
        sigma2_by_step=(0.3, 0.2, 0.1, 0.05, 0.02),
    ),
    "calibrated-entropy": TemperaturePolicy(
        rule=Rule.CALIBRATED,
        calibrated=CalibratedTable(
            step_edges=(0, 16),
            entropy_edges=(0.0, 1.0, 2.0, 3.0),
            temperatures=(((0.9, 1.0, 1.1, 1.2), (1.0, 1.1, 1.2, 1.3)),),
        ),
    ),
}
BIASED = "sqrt+bias"
"""The ``sqrt`` policy with a per-token bias (made per vocabulary size by `_policy`)."""


class _Counter:
    """A stand-in for vLLM's UVA-backed per-slot tensors: ``.np`` on the host, ``.gpu`` on the
    benchmark device."""

    def __init__(self, values: torch.Tensor) -> None:
        self.gpu = values
        self.np = values.cpu().numpy()


def _params(policy: TemperaturePolicy, row: int) -> SamplingParams:
    keys = {"nts_policy": policy.to_json(), "nts_trace_id": f"bench-{row}"}
    return SamplingParams(temperature=0.8, extra_args=keys)


@contextlib.contextmanager
def _policy(rule: str, vocab: int) -> Iterator[TemperaturePolicy]:
    """The policy of ``rule``; for `BIASED`, ``sqrt`` with a random bias of ``vocab`` entries
    saved in a temporary bias directory (``NTS_BIAS_DIR`` while the processor is built)."""
    if rule != BIASED:
        yield POLICIES[rule]
        return
    bias = torch.randn(vocab)
    with tempfile.TemporaryDirectory() as folder:
        save_bias_file(Path(folder), bias)
        policy = dataclasses.replace(POLICIES["sqrt"], bias=bias_sha256(bias))
        os.environ[BIAS_DIR_ENV] = folder
        try:
            yield policy
        finally:
            del os.environ[BIAS_DIR_ENV]


Step = Callable[[torch.Tensor], Any]


def _v1_step(
    policy: TemperaturePolicy, batch: int, vocab: int, device: torch.device
) -> tuple[Any, Step]:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=batch),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
    )
    processor = NoisyTemperatureLogitsProcessor(config, device, device.type == "cuda")
    outputs = [[0] for _ in range(batch)]  # decoding: every row has produced a token
    added = [(row, _params(policy, row), None, outputs[row]) for row in range(batch)]
    processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    for row_outputs in outputs:
        row_outputs.append(0)

    def step(logits: torch.Tensor) -> Any:
        processor.update_state(None)
        return processor.apply(logits)

    return processor, step


def _v2_step(
    policy: TemperaturePolicy,
    batch: int,
    vocab: int,
    device: torch.device,
    *,
    freed_untuned: bool = False,
) -> tuple[Any, Step]:
    """``freed_untuned``: slot ``batch`` held a greedy request that has finished (not in the
    step's batch)."""
    slots_in_all = batch + freed_untuned
    prompt = torch.full((slots_in_all,), 16, dtype=torch.int32, device=device)
    state = LogitsProcRequestState(
        device=device,
        max_num_reqs=slots_in_all,
        vocab_size=vocab,
        all_token_ids=None,  # type: ignore[arg-type]  (not read by the processor)
        prompt_len=_Counter(prompt),  # type: ignore[arg-type]
        prefill_len=_Counter(prompt),  # type: ignore[arg-type]
        total_len=None,  # type: ignore[arg-type]
    )
    processor = NoisyTemperatureLogitsProcessor(SimpleNamespace(), state)
    for slot in range(batch):
        processor.add_request(slot, _params(policy, slot))
    if freed_untuned:
        processor.add_request(batch, SamplingParams(temperature=0.0))
    processor.apply_staged_writes()
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    positions = torch.full((batch,), 16, dtype=torch.int64, device=device)
    ctx = LogitsContext(
        expanded_idx_mapping=slots,
        idx_mapping=slots,
        idx_mapping_np=np.arange(batch, dtype=np.int32),
        expanded_local_pos=torch.zeros_like(slots),
        input_ids=torch.zeros_like(slots),
        pos=positions,
        seq_lens_upper_bound_np=np.zeros(batch, dtype=np.int32),
    )

    def step(logits: torch.Tensor) -> Any:
        processor.apply_staged_writes()
        return processor.apply(logits, ctx)  # positions stay: the cost does not depend on them

    return processor, step


def _median_ms(
    fn: Callable[[], Any], steps: int, device: torch.device, reset: Callable[[], Any]
) -> float:
    """Median wall ms of ``fn`` over ``steps`` calls, each after an untimed ``reset``."""
    times = []
    for _ in range(steps):
        reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def measure(
    runner: str,
    rule: str,
    batch: int,
    vocab: int,
    *,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    with _policy(rule, vocab) as policy:
        if runner == "v1":
            processor, step = _v1_step(policy, batch, vocab, device)
        else:
            freed = runner == "v2-freed"
            processor, step = _v2_step(policy, batch, vocab, device, freed_untuned=freed)
    served = torch.randn(batch, vocab, device=device)
    logits = served.clone()

    def reset() -> None:  # every step divides fresh logits (repeated division would drift
        logits.copy_(served)  # them into subnormals, which are slower to divide)

    temperature = torch.full((batch, 1), 1.3, device=device)
    with torch.inference_mode():  # as vLLM's model runners run the sampler
        for _ in range(3):
            reset()
            step(logits)
        apply_ms = _median_ms(lambda: step(logits), steps, device, reset)
        divide_ms = _median_ms(lambda: logits.div_(temperature), steps, device, reset)
        add_ms = 0.0
        if rule == BIASED:
            vector = served[0].clone()
            add_ms = _median_ms(lambda: logits.add_(vector), steps, device, reset)
    processor.tuning.reporter.close()  # its thread would compete with the next measurement
    return {
        "runner": runner,
        "rule": rule,
        "batch": batch,
        "vocab": vocab,
        "apply_ms": round(apply_ms, 4),
        "divide_ms": round(divide_ms, 4),
        "add_ms": round(add_ms, 4),
        "overhead_ms": round(apply_ms - divide_ms - add_ms, 4),
    }


def _least_disturbed(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the smallest overhead (on a shared machine, the least disturbed one; the
    cost without interference), with the median overhead of all rounds."""
    best = min(rounds, key=lambda row: row["overhead_ms"])
    median = statistics.median(row["overhead_ms"] for row in rounds)
    return {**best, "overhead_ms_median": round(median, 4), "rounds": len(rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[1024, 128_000])
    parser.add_argument(
        "--rules", nargs="+", choices=[*POLICIES, BIASED], default=[*POLICIES, BIASED]
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps (vocab 1024)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="measurements per configuration, spread in time"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no OpenMP barrier noise)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    configurations = [
        (runner, rule, batch, vocab)
        for vocab in args.vocabs
        for batch in args.batches
        for rule in args.rules
        for runner in ("v1", "v2", "v2-freed")
    ]
    measured: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    with TraceCollector(f"ipc://{tempfile.mkdtemp()}/bench.sock") as collector:
        os.environ[TRACE_ENDPOINT_ENV] = collector.endpoint
        for _ in range(args.rounds):
            for runner, rule, batch, vocab in configurations:
                steps = args.steps if vocab <= 4096 else max(5, args.steps // 20)
                row = measure(runner, rule, batch, vocab, steps=steps, device=device)
                print(json.dumps(row), flush=True)
                measured.setdefault((runner, rule, batch, vocab), []).append(row)
    rows = [_least_disturbed(rounds) for rounds in measured.values()]
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "device": str(device),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/processor_bench.py",
    }
    (RESULTS / "processor_bench.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    lines = [
        "# Processor host time per step (`benchmarks/processor_bench.py`)",
        "",
        f"device {meta['device']}, torch {meta['torch']}, {meta['threads']} torch thread(s), "
        f"load average {meta['load_average_1min']:.1f} when done. "
        "apply: median ms per step of `apply()`; divide: the bare division; add: the bare add "
        "of one [V] bias vector (bias rule); overhead: apply - divide - add, in the least "
        f"disturbed of {args.rounds} rounds (median over the rounds).",
        "",
        "| runner | rule | batch | vocab | apply ms | divide ms | add ms | overhead ms (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['runner']} | {r['rule']} | {r['batch']} | {r['vocab']} | {r['apply_ms']} | "
        f"{r['divide_ms']} | {r['add_ms']} | {r['overhead_ms']} "
        f"({r['overhead_ms_median']}) |"
        for r in rows
    ]
    (RESULTS / "processor_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
