"""What tuning costs a served request, measured by vLLM's own benchmark client, `vllm bench
serve`: our server with every request tuned against the same server with no request tuned, on
the same checkpoint, policy and engine settings.

- ``nts-untuned``: ``noisy-temp-server serve --profile P --default-rule off`` (T* = 1: the
  processor leaves every row alone, no T* summary is awaited);
- ``nts-tuned``: the same with the profile's rule in force on every request.

The default profile is the shipped default pair's (`noisy_temp_server/data`), served on the
default pair (the embedded model with its runtime logit noise), with its per-token bias left
out and its calibrated T* table made to depend on the served row's entropy (each step bucket's
T* times 0.9, 1.0, 1.1, 1.2 over the four entropy buckets): the rule that reads the whole served
row at every step, the costliest on a CPU. ``--profile`` and ``--model`` serve another pair as
it is (the int4 profile's ``calibrated`` rule on its checkpoint, say).

Shadow scoring is off in both. The servers start once; each round runs ``vllm bench serve``
(``vllm_bench_serve.bench_round``: random prompts, EOS ignored) against both, back to back, the
order alternating, so a pair sees the same machine load. The first round is a warm-up.
Reported: each server's median output tokens per second and per CPU-second of its processes
(API, engine, worker) over ``--repeats`` rounds (min-max), and tuned / untuned as the median of
the per-round ratios (min-max). Saved as JSON + markdown under
``benchmarks/results/``.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_bench_tuned.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

from serving import ServerProcess
from throughput import RESULTS_DIR, cpu_seconds, rotated
from vllm_bench_serve import MODEL_NAME, add_round_options, bench_round, summary

from noisy_temp_server.checkpoints.default_model import default_model_dir
from noisy_temp_server.files import default_cache_dir

UNTUNED, TUNED = "nts-untuned", "nts-tuned"
SHIPPED_PROFILE = (
    Path(__file__).resolve().parents[1] / "noisy_temp_server/data/default-pair.profile.json"
)
ENTROPY_FACTORS = (0.9, 1.0, 1.1, 1.2)


def entropy_profile(folder: Path) -> Path:
    """The shipped profile without its bias, its calibrated table varied over the entropy
    buckets (`ENTROPY_FACTORS`), written into ``folder``."""
    profile = json.loads(SHIPPED_PROFILE.read_text())
    profile["bias"]["recommended"] = False
    table = profile["parameters"]["calibrated_temperatures"]
    for band in table:
        for step_row in band:
            step_row[:] = [t * f for t, f in zip(step_row, ENTROPY_FACTORS, strict=True)]
    path = folder / "entropy.profile.json"
    path.write_text(json.dumps(profile))
    return path


def _servers(args: argparse.Namespace, profile: Path) -> list[ServerProcess]:
    served = [] if args.model is None else ["--served-model", str(args.model)]
    ours = [sys.executable, "-m", "noisy_temp_server.cli", "serve", *served,
            "--served-model-name", MODEL_NAME, "--profile", str(profile),
            "--shadow-fraction", "0", "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-model-len", str(args.max_model_len), "--max-num-seqs",
            str(args.max_concurrency), "--dtype", args.dtype,
            "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return [
        ServerProcess(UNTUNED, [*ours, "--default-rule", "off"], env),
        ServerProcess(TUNED, ours, env),
    ]


def measure(
    args: argparse.Namespace, profile: Path, tokenizer: Path
) -> dict[str, dict[str, list[float]]]:
    """Per kind (``wall``: output tokens per second; ``cpu``: output tokens per CPU-second of
    the server's processes, which other work on the machine disturbs far less) and server, one
    value per measured round."""
    figures: dict[str, dict[str, list[float]]] = {
        kind: {UNTUNED: [], TUNED: []} for kind in ("wall", "cpu")
    }
    with ExitStack() as stack:
        servers = _servers(args, profile)
        for server in servers:
            stack.callback(server.stop)
        for server in servers:
            server.wait_healthy(args.startup_timeout)
        for repeat in range(args.repeats + 1):
            for server in rotated(servers, repeat):
                cpu_before = cpu_seconds(server.process.pid)
                result = bench_round(server, args, tokenizer, seed=repeat)
                per_cpu = result["total_output_tokens"] / (
                    cpu_seconds(server.process.pid) - cpu_before
                )
                wall = result["output_throughput"]
                print(f"round {repeat} {server.name}: {wall:.1f} tok/s, {per_cpu:.1f} tok/CPU-s")
                if repeat > 0:
                    figures["wall"][server.name].append(wall)
                    figures["cpu"][server.name].append(per_cpu)
    return figures


def table(figures: dict[str, dict[str, list[float]]]) -> str:
    """The markdown table of `measure`'s figures."""
    lines = ["| server | measure | output tokens (median, min-max) "
             "| tuned / untuned (median, min-max) |", "|---|---|---|---|"]  # fmt: skip
    for kind, unit in (("wall", "per s"), ("cpu", "per CPU-s")):
        values = figures[kind]
        pairs = zip(values[TUNED], values[UNTUNED], strict=True)
        ratios = summary([tuned / untuned for tuned, untuned in pairs])
        for name, rounds in values.items():
            s = summary(rounds)
            ratio = f"{ratios['median']:.3f} ({ratios['min']:.3f}-{ratios['max']:.3f})"
            ratio = "1" if name == UNTUNED else ratio
            lines.append(
                f"| {name} | {unit} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | {ratio} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="served checkpoint (default: the default pair)")
    parser.add_argument("--profile", type=Path, help="profile (default: see the docstring)")
    parser.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    add_round_options(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nts-bench-tuned-") as folder:
        profile = args.profile or entropy_profile(Path(folder))
        figures = measure(args, profile, args.model or default_model_dir(default_cache_dir()))
    text = table(figures)
    print(text)
    command = " ".join(["benchmarks/vllm_bench_tuned.py", *sys.argv[1:]])
    machine = f"{platform.platform()} ({os.cpu_count()} CPUs)"
    minutes = (time.perf_counter() - started) / 60
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {"command": command, "machine": machine, "minutes": minutes,
                "settings": {k: str(v) for k, v in vars(args).items()},
                "output_tokens": figures}  # fmt: skip
    (RESULTS_DIR / f"vllm-bench-tuned-{stamp}.json").write_text(json.dumps(document, indent=2))
    (RESULTS_DIR / f"vllm-bench-tuned-{stamp}.md").write_text(
        "# `vllm bench serve`: our server with every request tuned against none tuned\n\n"
        f"`{command}` on {machine}, {stamp}, {minutes:.1f} min.\n\n{text}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
