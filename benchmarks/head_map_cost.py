"""What a head map costs a processor step: `HeadMap.apply` (two [B, V] x [V, r] products per
step) beside the per-token bias's one vector add, per batch size, on the CPU or a CUDA device.

The bare arithmetic of the map (`correction.head_map`) at the embedded model's vocabulary and
the ranks calibration may fit (its hidden size, 576, is the most); the processor's whole step
with a map is `benchmarks/processor_bench.py --rules sqrt+bias+map`. Random logits and a random
map: the cost does not depend on their values. Per (batch, rank): `--repeats` timed calls after
two warm-ups, min / median / max microseconds (CUDA timed with events after a synchronise, so
the figures are device time). Saved as JSON under benchmarks/results/.

    .venv/bin/python benchmarks/head_map_cost.py [--vocab 49152] [--ranks 64,128,576]
        [--batches 1,8,64,256] [--device cpu] [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from noisy_temp_server.correction.head_map import HeadMap

RESULTS = Path(__file__).resolve().parent / "results"


def _microseconds(call: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize(device)
            times.append(1e3 * start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            times.append(1e6 * (time.perf_counter() - began))
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--ranks", default="64,128,576")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "head_map_cost.json")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    print(f"device {device}, vocab {args.vocab}, {torch.get_num_threads()} threads; microseconds")
    print("| batch | rank | bias add (min / median) | head map (min / median / max) |")
    print("|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab, device=device, generator=generator)
        bias = torch.randn(args.vocab, device=device, generator=generator)
        added = _summary(_microseconds(functools.partial(logits.add_, bias), device, args.repeats))
        for rank in (int(r) for r in args.ranks.split(",")):
            head_map = HeadMap(
                left=torch.randn(args.vocab, rank, device=device, generator=generator),
                right=torch.randn(rank, args.vocab, device=device, generator=generator),
            )
            mapped = _summary(
                _microseconds(functools.partial(head_map.apply, logits), device, args.repeats)
            )
            results.append({"batch": batch, "rank": rank, "bias_add": added, "head_map": mapped})
            print(
                f"| {batch} | {rank} | {added['min']:.0f} / {added['median']:.0f} "
                f"| {mapped['min']:.0f} / {mapped['median']:.0f} / {mapped['max']:.0f} |",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"device": str(device), "vocab": args.vocab, "results": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
