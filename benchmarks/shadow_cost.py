"""What the shadow scorer costs in serving throughput: its sampling fraction vs fraction 0.

Two `noisy-temp-server serve` processes run side by side on the default pair (the embedded
SmolLM2-135M-Instruct with `serve`'s default perturbation, the clean model kept for scoring;
each server prepares it as `serve` does), identical except for ``--shadow-fraction``: ``off``
(0) and ``shadow`` (``--fraction``, default the setting's default, 0.1, within the scorer's
CPU budget: the settings' defaults, or ``--cpu-share``). Rounds alternate
between the two servers, so both see the same machine load. A round sends ``--requests``
completions through HTTP from ``--streams`` concurrent clients (``max_tokens=--max-tokens``,
EOS ignored, ``nts_tune=false`` so the two servers do the same engine work and only the scorer
differs) and measures

- serving throughput: generated tokens / round wall time (what clients see while the scorer
  competes with the engine for the CPU or GPU);
- drain time: after a ``shadow`` round, how long the scorer still works on the requests it
  sampled in that round (the next round starts only when it is idle, so no round pays for
  another's scoring). Sustained throughput = tokens / (round + drain) is the throughput the
  server could keep up indefinitely while scoring every sampled request.

Before the rounds, the ``shadow`` server is timed to its first online policy: ``--streams``
clients send completions of ``--policy-max-tokens`` tokens without pause until the status
endpoint shows policy version 1 (the estimator needs ``shadow_min_positions`` scored positions);
the time from the first request, the positions scored by then and the alpha it published are
reported.

Reported: medians over ``--repeats`` rounds per server (after one warm-up round each), the
shadow/off throughput ratios (of the medians, and pooled: all rounds' tokens over all rounds'
time, drains included), the load average at each round, and the scorer's own cost from
``/v1/nts/status``
(``seconds_per_scored_token``: the clean model's teacher-forced pass and the scoring, per
scored completion token; the served rows come from the engine's capture; in the JSON also its
time split: scoring, waiting for captured rows, estimation, thread CPU), as
a table on stdout and as JSON + markdown under ``benchmarks/results/``. Sampling is random, so
the number of scored requests per round varies; it is reported.

    .venv/bin/python benchmarks/shadow_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from serving import ServerProcess, completions_round

from noisy_temp_server.settings import Settings

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL_NAME = "shadow-cost"
PROMPT = "Write a short story about a lighthouse keeper who"


@dataclass(frozen=True)
class Round:
    server: str
    repeat: int
    seconds: float
    drain_seconds: float
    tokens: int
    scored_requests: int
    load_average: float


@dataclass(frozen=True)
class Summary:
    server: str
    fraction: float
    rounds: int
    tokens_per_s: float
    sustained_tokens_per_s: float
    ratio_to_off: float
    sustained_ratio_to_off: float
    pooled_sustained_ratio_to_off: float
    scored_requests: int
    skipped_budget: int
    scored_tokens: int
    seconds_per_scored_token: float | None
    scorer_seconds: dict[str, float]


SCORER_SECONDS = (
    "score_seconds_total",
    "rows_wait_seconds_total",
    "estimation_seconds_total",
    "cpu_seconds_total",
)
"""The scorer's time split over the whole run (warm-up included), from its status."""


class Server(ServerProcess):
    """One `serve` subprocess scoring ``fraction`` of its requests."""

    def __init__(self, name: str, fraction: float, args: argparse.Namespace) -> None:
        command = [
            sys.executable, "-m", "noisy_temp_server.cli", "serve",
            "--served-model-name", MODEL_NAME, "--shadow-fraction", str(fraction),
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.streams),
            "--kv-cache-gib", str(args.kv_cache_gib), "--log-level", "warning",
        ]  # fmt: skip
        if args.cpu_share is not None:
            command += ["--shadow-cpu-share", str(args.cpu_share)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each server its own fresh directory
        super().__init__(name, command, env)
        self.fraction = fraction

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(f"{self.url}/v1/nts/status", timeout=10).json()
        return status

    def shadow_status(self) -> dict[str, Any]:
        return dict(self.status()["shadow"])


@contextmanager
def _servers(args: argparse.Namespace) -> Iterator[list[Server]]:
    with ExitStack() as stack:
        servers = []
        for name, fraction in (("off", 0.0), ("shadow", args.fraction)):
            server = Server(name, fraction, args)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.wait_healthy(args.startup_timeout)
        yield servers


async def _load(server: Server, args: argparse.Namespace, seed: int) -> int:
    """Send `args.requests` completions over `args.streams` concurrent clients; return the
    number of generated tokens."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "nts_tune": False,
    }
    return await completions_round(
        server.url, body, requests=args.requests, streams=args.streams, seed=seed
    )


async def _first_policy(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Load `server` from `args.streams` clients until its estimator publishes version 1."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": args.policy_max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
    }
    published = asyncio.Event()
    started = time.perf_counter()

    async def client(http: httpx.AsyncClient, index: int) -> None:
        request = 0
        while not published.is_set():
            seed = 10_000_000 + 1000 * index + request
            response = await http.post("/v1/completions", json={**body, "seed": seed})
            response.raise_for_status()
            request += 1

    async def watch(http: httpx.AsyncClient) -> dict[str, Any]:
        while time.perf_counter() - started < args.policy_timeout:
            status = (await http.get("/v1/nts/status")).json()
            if status["estimator"]["policy_version"] >= 1:
                published.set()
                return {
                    "seconds": time.perf_counter() - started,
                    "scored_positions": status["shadow"]["tokens"],
                    "alpha_by_step": status["estimator"]["alpha_by_step"],
                }
            await asyncio.sleep(0.5)
        published.set()
        raise RuntimeError(f"no online policy within {args.policy_timeout} s")

    limits = httpx.Limits(max_connections=args.streams + 1)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
        clients = [client(http, i) for i in range(args.streams)]
        result, *_ = await asyncio.gather(watch(http), *clients)
    return dict(result)


def _drain(server: Server, timeout: float) -> float:
    """Seconds until every request the scorer sampled has been scored or dropped."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        status = server.shadow_status()
        if not status.get("enabled"):
            return 0.0
        dropped = status["dropped_queue_full"] + status["dropped_error"]
        handled = status["scored"] + dropped + status["dropped_not_captured"]
        if handled >= status["sampled"]:
            return time.perf_counter() - started
        time.sleep(0.05)
    raise RuntimeError(f"the {server.name} server's scorer did not drain in {timeout} s")


def _scored(server: Server) -> tuple[int, int]:
    status = server.shadow_status()
    return (int(status["scored"]), int(status["tokens"])) if status.get("enabled") else (0, 0)


def _run(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[Round], list[Summary]]:
    rounds: list[Round] = []
    with _servers(args) as servers:
        first_policy = asyncio.run(_first_policy(servers[1], args))
        print(
            f"first online policy after {first_policy['seconds']:.1f} s, "
            f"{first_policy['scored_positions']} scored positions",
            flush=True,
        )
        _drain(servers[1], args.drain_timeout)
        baseline: dict[str, tuple[int, int]] = {}
        for repeat in range(args.repeats + 1):
            for server in servers:
                scored_before, _ = _scored(server)
                started = time.perf_counter()
                tokens = asyncio.run(_load(server, args, seed=1000 * repeat))
                seconds = time.perf_counter() - started
                drain = _drain(server, args.drain_timeout)
                expected = args.requests * args.max_tokens
                if tokens != expected:
                    raise RuntimeError(f"{server.name}: expected {expected} tokens, got {tokens}")
                if repeat == 0:  # warm-up round, not reported
                    baseline[server.name] = _scored(server)
                    continue
                scored_after, _ = _scored(server)
                scored = scored_after - scored_before
                load = os.getloadavg()[0]
                rounds.append(Round(server.name, repeat, seconds, drain, tokens, scored, load))
                print(
                    f"round {repeat} {server.name:>6}: {tokens / seconds:6.1f} tokens/s, "
                    f"drain {drain:5.2f} s, scored {scored}, load {load:.1f}",
                    flush=True,
                )
        final = {server.name: (server, server.shadow_status()) for server in servers}
    summaries: list[Summary] = []
    off_rate = off_sustained = off_pooled = 0.0
    for name, (server, status) in final.items():
        mine = [r for r in rounds if r.server == name]
        rate = statistics.median(r.tokens / r.seconds for r in mine)
        sustained = statistics.median(r.tokens / (r.seconds + r.drain_seconds) for r in mine)
        pooled = sum(r.tokens for r in mine) / sum(r.seconds + r.drain_seconds for r in mine)
        if name == "off":
            off_rate, off_sustained, off_pooled = rate, sustained, pooled
        enabled = bool(status.get("enabled"))
        warm_scored, warm_tokens = baseline[name]
        summaries.append(
            Summary(
                server=name,
                fraction=server.fraction,
                rounds=len(mine),
                tokens_per_s=rate,
                sustained_tokens_per_s=sustained,
                ratio_to_off=rate / off_rate,
                sustained_ratio_to_off=sustained / off_sustained,
                pooled_sustained_ratio_to_off=pooled / off_pooled,
                scored_requests=int(status["scored"]) - warm_scored if enabled else 0,
                skipped_budget=int(status["skipped_budget"]) if enabled else 0,
                scored_tokens=int(status["tokens"]) - warm_tokens if enabled else 0,
                seconds_per_scored_token=status.get("seconds_per_scored_token"),
                scorer_seconds={key: status[key] for key in SCORER_SECONDS} if enabled else {},
            )
        )
    return first_policy, rounds, summaries


def _table(summaries: list[Summary]) -> str:
    lines = [
        "| server | shadow fraction | tokens/s | ratio to off | sustained tokens/s "
        "| sustained ratio | pooled sustained ratio | scored requests | skipped (budget) "
        "| scored tokens | scorer s/scored token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        cost = "-" if s.seconds_per_scored_token is None else f"{s.seconds_per_scored_token:.4f}"
        lines.append(
            f"| {s.server} | {s.fraction:g} | {s.tokens_per_s:.1f} | {s.ratio_to_off:.3f} | "
            f"{s.sustained_tokens_per_s:.1f} | {s.sustained_ratio_to_off:.3f} | "
            f"{s.pooled_sustained_ratio_to_off:.3f} | {s.scored_requests} | {s.skipped_budget} | "
            f"{s.scored_tokens} | {cost} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, default=Settings().shadow_fraction)
    parser.add_argument("--streams", type=int, default=16, help="concurrent HTTP clients")
    parser.add_argument("--requests", type=int, default=32, help="completions per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--policy-max-tokens", type=int, default=128)
    parser.add_argument("--policy-timeout", type=float, default=600.0)
    parser.add_argument("--cpu-share", type=float, help="--shadow-cpu-share (default: serve's)")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per server")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if not 0.0 < args.fraction <= 1.0:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")

    load_before = os.getloadavg()
    first_policy, rounds, summaries = _run(args)
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    command = " ".join(["benchmarks/shadow_cost.py", *sys.argv[1:]])
    machine = f"{platform.platform()} ({os.cpu_count()} CPUs)"
    table = _table(summaries)
    print(table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {
        "command": command,
        "machine": machine,
        "load": load,
        "timestamp": stamp,
        "settings": vars(args),
        "perturbation": Settings().perturbation,
        "first_policy": first_policy,
        "summaries": [asdict(s) for s in summaries],
        "rounds": [asdict(r) for r in rounds],
    }
    (RESULTS_DIR / f"shadow-cost-{stamp}.json").write_text(json.dumps(document, indent=2) + "\n")
    markdown = (
        "# Shadow scorer cost: serving throughput with and without scoring\n\n"
        f"`{command}` on {machine} ({load}), {stamp}; {args.streams} concurrent streams, "
        f"{args.requests} completions of {args.max_tokens} tokens per round, medians over "
        f"{args.repeats} rounds per server. Sustained = tokens / (round + time the scorer "
        "still needs for that round's samples).\n\n" + table + "\n\n"
        f"First online policy: {first_policy['seconds']:.1f} s after the first request of "
        f"{args.streams} streams ({first_policy['scored_positions']} scored positions).\n"
    )
    (RESULTS_DIR / f"shadow-cost-{stamp}.md").write_text(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
