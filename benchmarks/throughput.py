"""Decode throughput of the T* processor and of our HTTP server against stock vLLM, in one run.

Engine part (vLLM's offline ``LLM``; each round generates ``--max-tokens`` tokens, EOS ignored,
for ``--batch`` prompts submitted at once):

- ``stock``: an engine that cannot see this package's entry point, i.e. vLLM as it runs without
  noisy-temp-server installed (`stock_environment`);
- ``untuned``: the processor loaded (the installed entry point, as in every engine of an
  environment with this package) and no request tuned;
- ``tuned``: every request tuned by ``--rule`` (default ``sqrt``; every step-only rule is a
  table lookup and costs the same).

HTTP part (``--streams`` concurrent clients send ``--requests`` completions per round, the same
bodies to both servers):

- ``vllm-server``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``),
  stock;
- ``nts-server``: ``noisy-temp-server serve`` with shadow scoring off, every request tuned
  (``--default-rule fixed --default-t 1.2``), on the same checkpoint and engine settings,
  logprobs mode included: both return tuned logprobs (vLLM's ``processed_logprobs``, our
  default) unless ``--raw-logprobs`` gives both vLLM's default ``raw_logprobs``.

Every engine runs in its own process, started once; the variants of a part take turns round by
round (the order rotates), so all see the same machine load. The first round of each variant
warms up and is not reported. Reported per variant: the median tokens/s over ``--repeats``
rounds with its min-max, and each ratio as the median of the per-repeat ratios (rounds of one
repeat ran back to back) with its min-max. Targets on CPU at batch 32: untuned and tuned ≥ 0.98×
stock, nts-server ≥ 0.95× vllm-server. Saved as JSON + markdown under ``benchmarks/results/``.

    PYTHONPATH=. .venv/bin/python benchmarks/throughput.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import distribution, entry_points
from pathlib import Path
from typing import Any

import psutil
from serving import ServerProcess, completions_round, stop_process

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DISTRIBUTION = "noisy-temp-server"
ENTRY_POINT_GROUP = "vllm.logits_processors"
PROMPT = "Write a short story about a lighthouse keeper who"
MODEL_NAME = "throughput"
RESULT_PREFIX = "RESULT "


def stock_environment(directory: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables under which Python processes do not see this package's entry
    points: ``PYTHONPATH`` starts with ``directory``, where a metadata-only copy of the
    distribution (no ``entry_points.txt``) is written. ``importlib.metadata`` keeps the first
    distribution of a name found on ``sys.path``, so vLLM's processor loaders (both runners)
    find none of ours; the package itself stays importable. ``PYTHONSAFEPATH`` keeps the
    current directory off ``sys.path``: a checkout set up in place holds the build's
    ``noisy_temp_server.egg-info``, entry point included. This script's folder follows
    ``directory`` (its engine worker imports `serving`). Child processes inherit it all."""
    installed = distribution(DISTRIBUTION)
    name = installed.metadata["Name"]
    dist_info = directory / f"{name.replace('-', '_')}-{installed.version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {installed.version}\n"
    )
    env = dict(os.environ if base is None else base)
    search = (str(directory), str(Path(__file__).resolve().parent), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in search if p)
    env["PYTHONSAFEPATH"] = "1"
    return env


def visible_processor_entry_points() -> list[str]:
    """The ``vllm.logits_processors`` entry points this process sees, as ``name=value``."""
    return sorted(f"{e.name}={e.value}" for e in entry_points(group=ENTRY_POINT_GROUP))


# -- the engine worker (a subprocess; imports vLLM only) -------------------------------------


def _engine_worker(config: dict[str, Any]) -> None:
    """Build one ``LLM``, then answer one round per stdin line (JSON: extra_args, seed) with a
    ``RESULT {seconds, tokens}`` line on stdout. Everything else written to stdout (vLLM's logs,
    also those of its engine process) goes to stderr, so the pipe holds only results."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    llm = LLM(
        model=config["model"],
        max_model_len=config["max_model_len"],
        max_num_seqs=config["batch"],
        dtype=config["dtype"],
        enforce_eager=True,
        seed=0,
    )
    ready = {"entry_points": visible_processor_entry_points()}
    print(RESULT_PREFIX + json.dumps(ready), file=results, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(
            temperature=0.8,
            max_tokens=config["max_tokens"],
            ignore_eos=True,
            seed=request["seed"],
            extra_args=request["extra_args"],
        )
        started = time.perf_counter()
        outputs = llm.generate([PROMPT] * config["batch"], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {"seconds": seconds, "tokens": tokens}
        print(RESULT_PREFIX + json.dumps(result), file=results, flush=True)


class EngineProcess:
    """An `_engine_worker` subprocess (log in ``log_path``)."""

    def __init__(self, name: str, config: dict[str, Any], env: dict[str, str]) -> None:
        self.name = name
        self.log_path = Path(tempfile.gettempdir()) / f"nts-throughput-{name}-{os.getpid()}.log"
        command = [sys.executable, __file__, "--engine-worker", json.dumps(config)]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )

    def read_result(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(RESULT_PREFIX):
                result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
                return result
        raise RuntimeError(f"engine {self.name} exited; see {self.log_path}")

    def round(self, extra_args: dict[str, Any] | None, seed: int) -> tuple[float, int]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"extra_args": extra_args, "seed": seed}) + "\n")
        self.process.stdin.flush()
        result = self.read_result()
        return result["seconds"], result["tokens"]

    def stop(self) -> None:
        """End of stdin: the worker returns and vLLM shuts its engine process down (a signal
        would leave that process behind)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop_process(self.process)


# -- the HTTP servers ------------------------------------------------------------------------


def _http_round(server: ServerProcess, args: argparse.Namespace, seed: int) -> int:
    """One round of ``args.requests`` completions over ``args.streams`` clients; the tokens."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
    }
    return asyncio.run(
        completions_round(server.url, body, requests=args.requests, streams=args.streams, seed=seed)
    )


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    part: str
    variant: str
    repeat: int
    seconds: float
    cpu_seconds: float
    tokens: int

    @property
    def rates(self) -> dict[str, float]:
        """Tokens per wall second and per CPU second of the serving processes."""
        return {"wall": self.tokens / self.seconds, "cpu": self.tokens / self.cpu_seconds}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (all threads)."""
    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def rotated(items: list[Any], repeat: int) -> Iterator[Any]:
    shift = repeat % len(items)
    yield from items[shift:] + items[:shift]


def _tuned_extra_args(rule: str) -> dict[str, Any]:
    from noisy_temp_server.engine_contract.request_args import TuningKeys  # noqa: PLC0415
    from noisy_temp_server.temperature.policy import TemperaturePolicy  # noqa: PLC0415
    from noisy_temp_server.temperature.rules import Rule  # noqa: PLC0415

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


def _engine_part(args: argparse.Namespace, model: Path, stock_dir: Path) -> list[Round]:
    config = {
        "model": str(model),
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    rounds = []
    with ExitStack() as stack:
        engines = {}
        for name, engine_env in (("stock", stock_environment(stock_dir, env)), ("loaded", env)):
            engines[name] = EngineProcess(name, config, engine_env)
            stack.callback(engines[name].stop)
        for name, engine in engines.items():
            visible = engine.read_result()["entry_points"]
            ours = any("noisy_temp_server" in e for e in visible)
            if ours != (name == "loaded"):
                raise RuntimeError(f"engine {name} sees the entry points {visible}")
        variants = [
            ("stock", engines["stock"], None),
            ("untuned", engines["loaded"], None),
            (f"tuned-{args.rule}", engines["loaded"], _tuned_extra_args(args.rule)),
        ]
        for repeat in range(args.repeats + 1):
            for variant, engine, extra_args in rotated(variants, repeat):
                cpu_before = cpu_seconds(engine.process.pid)
                seconds, tokens = engine.round(extra_args, seed=1000 * repeat)
                cpu = cpu_seconds(engine.process.pid) - cpu_before
                if tokens != args.batch * args.max_tokens:
                    raise RuntimeError(
                        f"{variant}: {tokens} tokens, not {args.batch * args.max_tokens}"
                    )
                if repeat:
                    rounds.append(Round("engine", variant, repeat, seconds, cpu, tokens))
                    print(
                        f"engine round {repeat} {variant:>12}: {tokens / seconds:7.1f} tokens/s, "
                        f"{tokens / cpu:7.1f} tokens per CPU-s",
                        flush=True,
                    )
    return rounds


def _http_part(args: argparse.Namespace, model: Path, stock_dir: Path) -> list[Round]:
    shared = [
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.streams),
        "--dtype",
        args.dtype,
    ]
    vllm_server = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--enforce-eager", "--disable-uvicorn-access-log",
        "--logprobs-mode", "processed_logprobs" if args.tuned_logprobs else "raw_logprobs",
        *shared,
    ]  # fmt: skip
    nts_server = [
        sys.executable, "-m", "noisy_temp_server.cli", "serve", "--served-model", str(model),
        "--served-model-name", MODEL_NAME, "--shadow-fraction", "0", "--default-rule", "fixed",
        "--default-t", "1.2", "--kv-cache-gib", str(args.kv_cache_gib), "--log-level", "warning",
        "--tuned-logprobs", str(args.tuned_logprobs).lower(), "--enforce-eager", "true",
        *shared,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    rounds = []
    with ExitStack() as stack:
        servers = []
        for name, command, server_env in (
            ("vllm-server", vllm_server, stock_environment(stock_dir, env)),
            ("nts-server", nts_server, env),
        ):
            server = ServerProcess(name, command, server_env)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.wait_healthy(args.startup_timeout)
        for repeat in range(args.repeats + 1):
            for server in rotated(servers, repeat):
                cpu_before = cpu_seconds(server.process.pid)
                started = time.perf_counter()
                tokens = _http_round(server, args, seed=1000 * repeat)
                seconds = time.perf_counter() - started
                cpu = cpu_seconds(server.process.pid) - cpu_before
                if tokens != args.requests * args.max_tokens:
                    raise RuntimeError(
                        f"{server.name}: {tokens} tokens, not {args.requests * args.max_tokens}"
                    )
                if repeat:
                    rounds.append(Round("http", server.name, repeat, seconds, cpu, tokens))
                    print(
                        f"http round {repeat} {server.name:>12}: {tokens / seconds:7.1f} tokens/s, "
                        f"{tokens / cpu:7.1f} tokens per CPU-s",
                        flush=True,
                    )
    return rounds


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summaries(
    rounds: list[Round], ratios: list[tuple[str, str]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per variant and per ratio: median, min and max over the rounds, of tokens per wall second
    and per CPU second (ratios: of the rounds of one repeat, which ran back to back)."""
    by_variant: dict[str, dict[int, dict[str, float]]] = {}
    for r in rounds:
        by_variant.setdefault(r.variant, {})[r.repeat] = r.rates
    variants = [
        {
            "variant": name,
            "rounds": len(rates),
            **{key: _spread([rate[key] for rate in rates.values()]) for key in ("wall", "cpu")},
        }
        for name, rates in by_variant.items()
    ]
    compared = []
    for variant, baseline in ratios:
        mine, theirs = by_variant[variant], by_variant[baseline]
        compared.append(
            {
                "ratio": f"{variant} / {baseline}",
                **{
                    key: _spread([mine[k][key] / theirs[k][key] for k in mine])
                    for key in ("wall", "cpu")
                },
            }
        )
    return variants, compared


def _cell(spread: dict[str, float], digits: int) -> str:
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def _tables(variants: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | rounds | tokens/s, median (min-max) | tokens per CPU-s, median (min-max) |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {v['variant']} | {v['rounds']} | {_cell(v['wall'], 1)} | {_cell(v['cpu'], 1)} |"
        for v in variants
    ]
    lines += [
        "",
        "| ratio (paired rounds) | tokens/s, median (min-max) "
        "| tokens per CPU-s, median (min-max) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['ratio']} | {_cell(r['wall'], 3)} | {_cell(r['cpu'], 3)} |" for r in ratios]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32, help="prompts per engine round")
    parser.add_argument("--streams", type=int, default=32, help="concurrent HTTP clients")
    parser.add_argument("--requests", type=int, default=32, help="completions per HTTP round")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4, help="measured rounds per variant")
    parser.add_argument("--rule", default="sqrt", help="rule of the tuned engine variant")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--parts", nargs="+", choices=["engine", "http"], default=["engine", "http"]
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--raw-logprobs",
        dest="tuned_logprobs",
        action="store_false",
        help="both servers in vLLM's default raw_logprobs mode (ours: --tuned-logprobs false)",
    )
    args = parser.parse_args()
    if args.engine_worker:
        _engine_worker(json.loads(args.engine_worker))
        return 0

    from noisy_temp_server.checkpoints.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.settings import Settings  # noqa: PLC0415

    model = ensure_default_model(Settings().cache_dir)
    load_before = os.getloadavg()
    started = time.perf_counter()
    rounds: list[Round] = []
    ratios: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="nts-stock-") as stock_dir:
        if "engine" in args.parts:
            rounds += _engine_part(args, model, Path(stock_dir))
            ratios += [("untuned", "stock"), (f"tuned-{args.rule}", "stock")]
        if "http" in args.parts:
            rounds += _http_part(args, model, Path(stock_dir))
            ratios += [("nts-server", "vllm-server")]
    variants, compared = _summaries(rounds, ratios)
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    command = " ".join(["benchmarks/throughput.py", *sys.argv[1:]])
    machine = f"{platform.platform()} ({os.cpu_count()} CPUs)"
    minutes = (time.perf_counter() - started) / 60
    table = _tables(variants, compared)
    print(table)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {
        "command": command,
        "machine": machine,
        "load": load,
        "minutes": minutes,
        "settings": {k: v for k, v in vars(args).items() if k != "engine_worker"},
        "variants": variants,
        "ratios": compared,
        "rounds": [asdict(r) for r in rounds],
    }
    (RESULTS_DIR / f"throughput-{stamp}.json").write_text(json.dumps(document, indent=2) + "\n")
    (RESULTS_DIR / f"throughput-{stamp}.md").write_text(
        "# Throughput: stock vLLM, the processor, our server\n\n"
        f"`{command}` on {machine} ({load}), {stamp}, {minutes:.1f} min. Engine rounds: "
        f"{args.batch} prompts x {args.max_tokens} tokens; HTTP rounds: {args.requests} "
        f"completions x {args.max_tokens} tokens over {args.streams} streams.\n\n{table}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
