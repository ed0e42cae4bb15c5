"""Serving cost of a compensation adapter: `noisy-temp-server serve` on one served checkpoint
without an adapter (``none``), with a rank-``--rank`` adapter folded into the weights
(``folded``), and with the same adapter through vLLM's LoRA on the same weights (``lora``,
``--adapter-serving lora``); with ``--compressed`` also a w4a16 checkpoint of the clean model
without and with the adapter through LoRA (``w4a16-none``, ``w4a16-lora``).

The adapter is random (on the q, k, v, o, gate, up and down projections): its cost does not
depend on its values. Shadow scoring is off and no request is tuned, so the servers differ only
by the adapter. The servers start once, one after the other; each round sends ``--requests``
completions of ``--max-tokens`` tokens (EOS ignored) over ``--streams`` concurrent clients to
each server in turn, the order rotating; the first round warms up. Reported per server: median
output tokens/s over ``--repeats`` rounds (min-max), the median of the per-round ratios to
``none`` (w4a16: to ``w4a16-none``), and the resident memory of the server's processes (unique
set size, summed over the API process and the engine core) after the rounds. Default served
model: the embedded SmolLM2-135M-Instruct as int4 RTN group 128 (the issue's pair).

    PYTHONPATH=. nice .venv/bin/python benchmarks/adapter_serving.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import torch
from serving import ServerProcess, completions_round
from throughput import RESULTS_DIR

MODEL_NAME = "bench"
VARIANTS = ("none", "folded", "lora", "w4a16-none", "w4a16-lora")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter_folder(checkpoint: Path, rank: int, parent: Path) -> Path:
    """A random rank-`rank` adapter on every projection of `checkpoint`, saved in `parent`."""
    from noisy_temp_server.adapter.folded_checkpoint import linear_shapes  # noqa: PLC0415
    from noisy_temp_server.adapter.lora import (  # noqa: PLC0415
        LoraAdapter,
        LowRankDelta,
        save_peft_adapter,
    )

    generator = torch.Generator().manual_seed(0)
    layers = {
        name: LowRankDelta(
            down=torch.randn(rank, fan_in, generator=generator) / fan_in**0.5,
            up=1e-3 * torch.randn(fan_out, rank, generator=generator),
        )
        for name, (fan_out, fan_in) in linear_shapes(checkpoint).items()
        if name.rsplit(".", 1)[-1] in _MODULES
    }
    return save_peft_adapter(parent, LoraAdapter(layers=layers, rank=rank))


def served_checkpoints(args: argparse.Namespace) -> dict[str, Path]:
    """`float`: the served checkpoint (`--model`, or the default model as int4 g128); with
    `--compressed`, `w4a16`: the clean model quantized to w4a16, group 64 (576 = 9 x 64)."""
    from noisy_temp_server.checkpoints.compressed import write_compressed_checkpoint  # noqa: PLC0415
    from noisy_temp_server.checkpoints.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.checkpoints.perturbation import QuantizationSpec  # noqa: PLC0415
    from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint  # noqa: PLC0415

    clean = ensure_default_model(args.cache_dir)
    served = args.model or ensure_perturbed_checkpoint(
        clean, QuantizationSpec(format="int4", group_size=128), args.cache_dir
    )
    found = {"float": served}
    if args.compressed:
        w4a16 = args.cache_dir / "served" / f"{clean.name}-w4a16-g64"
        if not w4a16.exists():
            write_compressed_checkpoint(clean, "w4a16", w4a16, group_size=64)  # 576 = 9 x 64
        found["w4a16"] = w4a16
    return found


def _server_commands(
    args: argparse.Namespace, work: Path
) -> list[tuple[str, list[str], dict[str, str]]]:
    checkpoints = served_checkpoints(args)
    adapter = random_adapter_folder(checkpoints["float"], args.rank, work / "adapters")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)

    def serve(checkpoint: Path, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "noisy_temp_server.cli", "serve",
            "--served-model", str(checkpoint), "--served-model-name", MODEL_NAME,
            "--shadow-fraction", "0", "--cache-dir", str(args.cache_dir),
            "--kv-cache-gib", str(args.kv_cache_gib), "--max-num-seqs", str(args.streams),
            "--max-model-len", str(args.max_model_len), "--log-level", "warning", *extra,
        ]  # fmt: skip

    variants = {
        "none": serve(checkpoints["float"]),
        "folded": serve(checkpoints["float"], "--adapter", str(adapter)),
        "lora": serve(checkpoints["float"], "--adapter", str(adapter), "--adapter-serving", "lora"),
    }
    if "w4a16" in checkpoints:
        variants["w4a16-none"] = serve(checkpoints["w4a16"])
        variants["w4a16-lora"] = serve(checkpoints["w4a16"], "--adapter", str(adapter))
    return [(name, command, env) for name, command in variants.items() if name in args.variants]


def _memory_mib(pid: int) -> float:
    """Unique set size of a process and its descendants, MiB."""
    root = psutil.Process(pid)
    total = 0
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += process.memory_full_info().uss
    return total / 2**20


def _round(server: ServerProcess, args: argparse.Namespace, seed: int) -> float:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": args.max_tokens,
            "temperature": 0.8, "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    tokens = asyncio.run(
        completions_round(server.url, body, requests=args.requests, streams=args.streams, seed=seed)
    )
    seconds = time.perf_counter() - started
    if tokens != args.requests * args.max_tokens:
        raise RuntimeError(f"{server.name}: {tokens} tokens, not {args.requests * args.max_tokens}")
    return tokens / seconds


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s per server and round, and each server's memory after the rounds."""
    rates: dict[str, list[float]] = {}
    memory: dict[str, float] = {}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nts-adapter-bench-")))
        servers = []
        for name, command, env in _server_commands(args, work):
            server = ServerProcess(name, command, env)  # one at a time: memory peaks at start
            stack.callback(server.stop)
            server.wait_healthy(args.startup_timeout)
            servers.append(server)
        for repeat in range(args.repeats + 1):
            shift = repeat % len(servers)
            for server in servers[shift:] + servers[:shift]:
                rate = _round(server, args, seed=1000 * repeat)
                print(f"round {repeat} {server.name:>10}: {rate:7.1f} tokens/s", flush=True)
                if repeat:
                    rates.setdefault(server.name, []).append(rate)
        memory = {server.name: _memory_mib(server.process.pid) for server in servers}
    return {"rates": rates, "memory_mib": memory}


def _baseline(name: str) -> str:
    return "w4a16-none" if name.startswith("w4a16") else "none"


def summarize(measured: dict[str, Any]) -> list[dict[str, Any]]:
    rates = measured["rates"]
    rows = []
    for name, values in rates.items():
        baseline = rates.get(_baseline(name), values)
        ratios = [v / b for v, b in zip(values, baseline, strict=True)]
        rows.append(
            {
                "server": name,
                "tokens_per_s": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "memory_mib": measured["memory_mib"][name],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| server | output tokens/s (median, min-max) | vs no adapter (median, min-max) "
        "| memory, MiB (USS) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['server']} | {row['tokens_per_s']:.1f} ({row['min']:.1f}-{row['max']:.1f}) "
            f"| {row['ratio']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) "
            f"| {row['memory_mib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    from noisy_temp_server.files import default_cache_dir  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="served checkpoint (float)")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--compressed", action="store_true", help="also w4a16 with LoRA")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="servers to run"
    )
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()
    rows = summarize(measure(args))
    print(table(rows))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                "machine": platform.platform(), "cpus": os.cpu_count()}  # fmt: skip
    (RESULTS_DIR / f"adapter-serving-{stamp}.json").write_text(json.dumps(document, indent=2))
    (RESULTS_DIR / f"adapter-serving-{stamp}.md").write_text(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
