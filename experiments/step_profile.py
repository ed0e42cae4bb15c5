"""Where the step's host time goes: `gpu_check.py`'s harness (traced and captured slots, and
quiet) at one size, profiled with cProfile (Python's calls) and torch's profiler (the ops and
kernels). Writes one text file per (rule, correction, observed) under ``--out``.

    python experiments/step_profile.py --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "benchmarks")]

from gpu_check_parts.step import POLICIES, STEPS, Correction, StepHarness, served_logits


def profile_case(rule: str, correction: str, observed: bool, args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    fixture = Correction.random(args.vocab, generator)
    source = served_logits(args.batch, args.vocab, generator).to(device)
    harness = StepHarness(
        fixture.policy(POLICIES[rule], correction),
        args.batch,
        args.vocab,
        device,
        corrections=fixture.source(),
        report_interval_s=0.02,
        observed=observed,
    )
    logits = source.clone()
    keys, steps = harness.keys(STEPS[1])
    out = io.StringIO()
    try:
        with torch.inference_mode():
            for _ in range(5):
                harness.step(logits, keys, steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            host = []
            for _ in range(args.steps):
                logits.copy_(source)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                harness.step(logits, keys, steps)
                host.append((time.perf_counter() - start) * 1e6)
            host.sort()
            print(
                f"host us per step: median {host[len(host) // 2]:.1f} min {host[0]:.1f}", file=out
            )
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(10 * args.steps):
                harness.step(logits, keys, steps)
            profiler.disable()
            if device.type == "cuda":
                torch.cuda.synchronize()
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(args.steps):
                    harness.step(logits, keys, steps)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=out)
            if device.type == "cuda":
                print(
                    prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20),
                    file=out,
                )
    finally:
        harness.close()
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rules", nargs="+", default=["calibrated", "fisher", "schedule"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for rule in args.rules:
        for observed in (True, False):
            name = f"{rule}-bias-{'observed' if observed else 'quiet'}.txt"
            text = profile_case(rule, "bias", observed, args)
            (args.out / name).write_text(text)
            print(name, text.splitlines()[0], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
