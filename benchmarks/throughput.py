"""Decode throughput and latency with the temperature processor vs without it, side by side.

One vLLM engine (V1 model runner, CPU or GPU) serves two workloads, alternated repeat by repeat
so that both see the same machine load:

- ``baseline``: requests with ``nts_tune=false``: the processor is loaded (it is an installed
  entry point, as in every deployment of this package) but no row opts in, so vLLM runs its
  own sampler only -- `NoisyTemperatureLogitsProcessor.apply` returns at once;
- ``tuned-<rule>``: every request tuned by the given rule (default ``linear``, which needs no
  statistics of the row, and ``fisher``, which reads the served row: one log-softmax per step).

Each workload generates ``--max-tokens`` tokens (EOS ignored) for ``batch`` identical-length
prompts; throughput = generated tokens / wall time; latency = wall time / tokens per request.
Reported: the median over ``--repeats`` and the tuned/baseline throughput ratio, as a table on
stdout and as JSON + markdown under ``benchmarks/results/``.

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/throughput.py --batch-sizes 1 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from vllm import LLM, SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from noisy_temp_server.pairs.default_model import ensure_default_model
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor
from noisy_temp_server.vllm_plugin.request_args import TuningKeys

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Measurement:
    workload: str
    batch: int
    tokens_per_s: float
    ms_per_token_per_request: float
    repeats: int


def _policy_args(rule: str) -> dict[str, Any]:
    policy = TemperaturePolicy(
        version=1,
        rule=Rule(rule),
        step_edges=(0, 8, 32, 128, 512),
        alpha_by_step=(0.3, 0.25, 0.2, 0.15, 0.1),
        sigma2_by_step=(0.5, 0.4, 0.3, 0.2, 0.1),
        schedule_t_max=1.5,
        schedule_beta=0.05,
    )
    return TuningKeys(policy_json=policy.to_json()).to_extra_args()


def _run(args: argparse.Namespace) -> list[Measurement]:
    model = args.model or str(ensure_default_model(Settings().cache_dir))
    llm = LLM(
        model=model,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_sizes),
        seed=0,
        enforce_eager=True,
    )
    workloads: dict[str, dict[str, Any]] = {"baseline": {"nts_tune": False}}
    for rule in args.rules:
        workloads[f"tuned-{rule}"] = _policy_args(rule)

    prompt = "Write a short story about a lighthouse keeper who"
    results: list[Measurement] = []
    for batch in args.batch_sizes:
        timings: dict[str, list[float]] = {name: [] for name in workloads}
        for repeat in range(args.repeats + 1):
            for name, extra_args in workloads.items():
                params = SamplingParams(
                    temperature=0.8,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    seed=repeat,
                    extra_args=extra_args,
                )
                start = time.perf_counter()
                outputs = llm.generate([prompt] * batch, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                generated = sum(len(o.outputs[0].token_ids) for o in outputs)
                if generated != batch * args.max_tokens:
                    raise RuntimeError(
                        f"{name}: expected {batch * args.max_tokens} tokens, got {generated}"
                    )
                if repeat > 0:  # repeat 0 warms up
                    timings[name].append(elapsed)
        for name, seconds in timings.items():
            median = statistics.median(seconds)
            results.append(
                Measurement(
                    workload=name,
                    batch=batch,
                    tokens_per_s=batch * args.max_tokens / median,
                    ms_per_token_per_request=1000.0 * median / args.max_tokens,
                    repeats=len(seconds),
                )
            )
    return results


def _processor_step_cost(
    batch_sizes: list[int], rules: list[str], vocab: int, steps: int = 200
) -> list[dict[str, Any]]:
    """Microseconds per `apply` call of the processor alone on [B, vocab] CPU logits (the
    engine-free cost per decode step: grouping, rule, division, histogram)."""
    registry = CollectorRegistry()
    rows: list[dict[str, Any]] = []
    for batch in batch_sizes:
        for rule in rules:
            config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=batch))
            processor = NoisyTemperatureLogitsProcessor(
                config,  # type: ignore[arg-type]
                torch.device("cpu"),
                False,
                registry=registry,
            )
            params = SamplingParams(temperature=0.8, extra_args=_policy_args(rule))
            added = [(row, params, None, [0] * row) for row in range(batch)]
            processor.update_state(BatchUpdate(batch, removed=[], added=added, moved=[]))
            logits = torch.randn(batch, vocab)
            for _ in range(10):
                processor.apply(logits)
            start = time.perf_counter()
            for _ in range(steps):
                processor.apply(logits)
            rows.append(
                {
                    "batch": batch,
                    "rule": rule,
                    "vocab": vocab,
                    "us_per_step": 1e6 * (time.perf_counter() - start) / steps,
                }
            )
    return rows


def _table(results: list[Measurement]) -> str:
    baseline = {m.batch: m.tokens_per_s for m in results if m.workload == "baseline"}
    lines = [
        "| batch | workload | tokens/s | ms/token/request | ratio to baseline |",
        "|---:|---|---:|---:|---:|",
    ]
    for m in results:
        ratio = m.tokens_per_s / baseline[m.batch]
        lines.append(
            f"| {m.batch} | {m.workload} | {m.tokens_per_s:.1f} | "
            f"{m.ms_per_token_per_request:.2f} | {ratio:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rules", nargs="+", default=["linear", "fisher"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=49152, help="vocab of the step-cost table")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Before the engine starts: its busy process would skew the in-process timing.
    step_cost = _processor_step_cost(args.batch_sizes, args.rules, args.vocab)
    results = _run(args)
    table = _table(results)
    cost_table = "\n".join(
        [
            "| batch | rule | vocab | processor µs/step |",
            "|---:|---|---:|---:|",
            *(
                f"| {r['batch']} | {r['rule']} | {r['vocab']} | {r['us_per_step']:.0f} |"
                for r in step_cost
            ),
        ]
    )
    print(table)
    print()
    print(cost_table)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    meta = {
        "command": "benchmarks/throughput.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if v is not None and k != "output_dir"
        ),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "timestamp": stamp,
    }
    (args.output_dir / f"throughput-{stamp}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "results": [asdict(m) for m in results],
                "processor_step_cost": step_cost,
            },
            indent=2,
        )
        + "\n"
    )
    (args.output_dir / f"throughput-{stamp}.md").write_text(
        f"# Throughput: temperature processor vs baseline\n\n`{meta['command']}` on "
        f"{meta['machine']} ({meta['cpu_count']} CPUs), {stamp}\n\n{table}\n\n"
        f"Processor alone (no engine), per decode step:\n\n{cost_table}\n"
    )


if __name__ == "__main__":
    main()
