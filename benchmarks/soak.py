"""Soak: N concurrent clients for M minutes against a real server; nothing lost, nothing garbled,
memory flat.

Starts `noisy-temp-server serve` (the default model pair, or with ``--tiny`` the tiny random
Llama perturbed by weight noise, the clean one as the shadow reference) unless ``--url`` names
a running server. Each of ``--streams`` clients sends requests back to back until time is up,
cycling through a mix:

- ``rule``: a streamed completion with a per-request rule (``off``, ``fixed``, ``sqrt``,
  ``linear``, ``fisher``), usage in the last chunk;
- ``trace``: a completion asking for the per-step T* trace;
- ``n``: a completion with ``n`` = 3 choices;
- ``chat``: a streamed chat completion;
- ``cancel``: a streamed completion the client drops after its first chunks.

Every request ignores EOS, so a complete answer has exactly ``--max-tokens`` tokens per choice.
A request is *failed* when the status is not 200, the connection breaks or the stream carries
an error; *garbled* when it is a 200 whose content breaks an invariant (wrong number of choices
or tokens, a chunk that is not JSON, a missing ``[DONE]``, a trace of the wrong length);
*completed* otherwise; cancelled requests are counted apart. Reported: those counts, generated
tokens per second, and the resident memory (RSS) of the API process and of vLLM's engine core
every ``--sample-every`` seconds from the start (after a warm-up request), each sample with the
online estimator's window (positions seen, positions held), policy version and online bias
(rows fitted, largest change from the calibrated bias) from ``/v1/nts/status``. The growth
per 1 000 requests is given from the middle to the end, and from the first sample where the
estimator's window had stopped growing (it is full: what is left is what serving leaks) to the
end. Printed, and saved as JSON + markdown under ``benchmarks/results/``.

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/soak.py                 # 64 x 10 min
    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/soak.py --tiny --streams 16 --minutes 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

RESULTS_DIR = Path(__file__).resolve().parent / "results"
API_KEY = "soak-key"
MODEL = "soak-model"
KINDS = ("rule", "trace", "n", "chat", "cancel")
RULES = ({"nts_rule": "off"}, {"nts_rule": "fixed", "nts_t": 1.3}, {"nts_rule": "sqrt"},
         {"nts_rule": "linear"}, {"nts_rule": "fisher"})  # fmt: skip
N_CHOICES = 3


class Garbled(Exception):  # noqa: N818 (an outcome, not an error of this script)
    """A 200 whose content breaks an invariant."""


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    examples: list[str] = field(default_factory=list)

    def record(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if detail and len(self.examples) < 20:
            self.examples.append(f"{outcome}: {detail}")

    @property
    def requests(self) -> int:
        return sum(self.counts.values())


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise Garbled(what)


async def _events(response: httpx.Response, limit: int | None = None) -> list[Any]:
    """The stream's data payloads (parsed JSON, or the string `[DONE]`); at most `limit`."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            _expect(line == "", f"stray line {line[:60]!r}")
            continue
        payload = line.removeprefix("data: ")
        try:
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        except json.JSONDecodeError:
            raise Garbled(f"chunk is not JSON: {payload[:60]!r}") from None
        if limit is not None and len(events) >= limit:
            break
    return events


def _check_stream(events: list[Any], max_tokens: int, chat: bool) -> int:
    """Invariants of a finished stream; returns its completion tokens."""
    _expect(bool(events) and events[-1] == "[DONE]", "no [DONE] at the end")
    chunks = events[:-1]
    errors = [c for c in chunks if "error" in c]
    if errors:
        raise RuntimeError(f"in-band error: {errors[0]['error']['message'][:100]}")
    finished = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    _expect(len(finished) == 1, f"{len(finished)} finishing chunks")
    last = chunks[-1]
    _expect(last["usage"]["completion_tokens"] == max_tokens, f"usage {last['usage']}")
    _expect(last["nts"]["steps"] == max_tokens, f"nts steps {last['nts']['steps']}")
    if chat:
        _expect(chunks[0]["choices"][0]["delta"].get("role") == "assistant", "no role chunk")
    return max_tokens


def _check_json(body: dict[str, Any], n: int, max_tokens: int, trace: bool) -> int:
    choices = body["choices"]
    _expect(sorted(c["index"] for c in choices) == list(range(n)), "choice indices")
    _expect(body["usage"]["completion_tokens"] == n * max_tokens, f"usage {body['usage']}")
    for choice in choices:
        _expect(choice["finish_reason"] == "length", f"finish {choice['finish_reason']}")
        _expect(choice["nts"]["steps"] == max_tokens, "choice steps")
        if trace:
            _expect(len(choice["nts"]["trace"]) == max_tokens, "trace length")
    return n * max_tokens


def _body(kind: str, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    common = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
    prompt = f"Story {rng.randrange(10**6)}: once upon a time"
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        body = {**common, "messages": messages, "stream": True}
        return "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    body = {**common, "prompt": prompt, **rng.choice(RULES)}
    if kind in ("rule", "cancel"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    elif kind == "trace":
        body |= {"nts_trace": True}
    elif kind == "n":
        body |= {"n": N_CHOICES}
    return "/v1/completions", body


async def _one(
    client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally, max_tokens: int
) -> None:
    path, body = _body(kind, rng, max_tokens)
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                tally.record("failed", f"{kind} {response.status_code} {response.text[:100]}")
                return
            if kind == "cancel":
                await _events(response, limit=2)
                tally.record("cancelled")
                return
            if body.get("stream"):
                tokens = _check_stream(await _events(response), max_tokens, kind == "chat")
            else:
                data = json.loads(await response.aread())
                tokens = _check_json(data, body.get("n", 1), max_tokens, kind == "trace")
    except Garbled as error:
        tally.record("garbled", f"{kind}: {error}")
        return
    except (httpx.HTTPError, RuntimeError, KeyError, json.JSONDecodeError) as error:
        tally.record("failed", f"{kind}: {type(error).__name__}: {error}")
        return
    tally.tokens += tokens
    tally.record("completed")


async def _client_loop(
    url: str, index: int, deadline: float, tally: Tally, max_tokens: int
) -> None:
    rng = random.Random(index)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        turn = index
        while time.monotonic() < deadline:
            await _one(client, KINDS[turn % len(KINDS)], rng, tally, max_tokens)
            turn += 1


def _rss_mib(pid: int) -> dict[str, float]:
    """RSS of the API process and of vLLM's engine core below it (MiB)."""
    api = psutil.Process(pid)
    engine = [
        c for c in api.children(recursive=True) if "EngineCore" in c.name() + " ".join(c.cmdline())
    ]
    return {
        "api_mib": api.memory_info().rss / 2**20,
        "engine_mib": sum(p.memory_info().rss for p in engine) / 2**20,
    }


async def _estimator_window(client: httpx.AsyncClient) -> dict[str, Any]:
    """The online estimator's positions seen and held, its policy version, and the rows its
    online bias has fitted and the largest change it made (None where the server has none)."""
    try:
        estimator = (await client.get("/v1/nts/status")).json().get("estimator") or {}
    except (httpx.HTTPError, json.JSONDecodeError):
        estimator = {}
    bias = estimator.get("bias") or {}
    return {
        "positions_seen": estimator.get("positions_seen"),
        "window_positions": estimator.get("window_positions"),
        "policy_version": estimator.get("policy_version"),
        "bias_rows_fitted": bias.get("rows_fitted"),
        "bias_max_change": bias.get("max_change_from_calibrated"),
    }


async def _sample(
    client: httpx.AsyncClient, pid: int, started: float, tally: Tally
) -> dict[str, Any]:
    return {
        "t_s": time.monotonic() - started,
        "requests": tally.requests,
        **_rss_mib(pid),
        **await _estimator_window(client),
    }


async def _soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    tally = Tally()
    warm = Tally()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        for kind in KINDS:
            await _one(client, kind, random.Random(0), warm, args.max_tokens)
        started = time.monotonic()
        deadline = started + args.minutes * 60
        memory = [await _sample(client, pid, started, tally)]
        clients = [
            asyncio.create_task(_client_loop(url, i, deadline, tally, args.max_tokens))
            for i in range(args.streams)
        ]
        next_sample = started + args.sample_every
        while not all(c.done() for c in clients):
            await asyncio.sleep(1.0)
            if time.monotonic() >= next_sample:
                memory.append(await _sample(client, pid, started, tally))
                next_sample += args.sample_every
        await asyncio.gather(*clients)
        elapsed = time.monotonic() - started
        memory.append(await _sample(client, pid, started, tally))
    return _summary(args, tally, warm, elapsed, memory)


def _growth_per_1000(first: dict[str, Any], last: dict[str, Any], key: str) -> float | None:
    """MiB of ``key`` gained per 1 000 requests between two samples (None: no requests)."""
    requests = last["requests"] - first["requests"]
    return (last[key] - first[key]) / requests * 1000 if requests > 0 else None


def _window_full_sample(memory: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first sample at which the estimator's window was full: it held at least 95 % of the
    most it ever held, and by the end it had dropped records (positions seen > the most held).
    None when it never filled, or the server has no estimator."""
    held = [m["window_positions"] or 0 for m in memory]
    seen = memory[-1]["positions_seen"] or 0
    if max(held) == 0 or seen <= max(held):
        return None
    return next(m for m, h in zip(memory, held, strict=True) if h >= 0.95 * max(held))


def _summary(
    args: argparse.Namespace,
    tally: Tally,
    warm: Tally,
    elapsed: float,
    memory: list[dict[str, Any]],
) -> dict[str, Any]:
    end = memory[-1]
    middle = min(memory, key=lambda m: abs(m["t_s"] - end["t_s"] / 2))
    full = _window_full_sample(memory)
    return {
        "streams": args.streams,
        "minutes": args.minutes,
        "max_tokens": args.max_tokens,
        "seconds": elapsed,
        "requests": tally.requests,
        "completed": tally.counts["completed"],
        "failed": tally.counts["failed"],
        "garbled": tally.counts["garbled"],
        "cancelled": tally.counts["cancelled"],
        "warm_up_failed_or_garbled": warm.counts["failed"] + warm.counts["garbled"],
        "tokens_per_s": tally.tokens / elapsed,
        "memory": memory,
        "api_growth_mib_per_1000_requests": _growth_per_1000(middle, end, "api_mib"),
        "engine_growth_mib_per_1000_requests": _growth_per_1000(middle, end, "engine_mib"),
        "window_full_at_s": full["t_s"] if full else None,
        "api_growth_after_window_full_mib_per_1000_requests": (
            _growth_per_1000(full, end, "api_mib") if full else None
        ),
        "examples": tally.examples + warm.examples,
    }


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """A server to soak: (url, API process id)."""
    if args.url:
        yield args.url, args.api_pid
        return
    with tempfile.TemporaryDirectory(prefix="nts-soak-") as tmp:
        work = Path(tmp)
        command = [sys.executable, "-m", "noisy_temp_server.cli", "serve",
                   "--port", str(args.port), "--api-key", API_KEY,
                   "--served-model-name", MODEL, "--log-level", "warning"]  # fmt: skip
        if args.tiny:
            command += _tiny_pair(work)
        log = (work / "server.log").open("w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{args.port}"
        try:
            _wait_healthy(url, process, work / "server.log")
            yield url, process.pid
        finally:
            process.terminate()
            process.wait(timeout=120)


def _tiny_pair(work: Path) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_model import build_tiny_llama  # noqa: PLC0415  (a test model)

    from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec  # noqa: PLC0415
    from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint  # noqa: PLC0415

    clean = build_tiny_llama(work / "tiny-llama", seed=0)
    served = ensure_perturbed_checkpoint(clean, WeightNoiseSpec(scale=0.3), work)
    return ["--served-model", str(served), "--clean-model", str(clean), "--cache-dir", str(work),
            "--max-model-len", "256", "--shadow-min-positions", "256"]  # fmt: skip


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1.0)
    raise SystemExit("server not healthy in 15 minutes")


def _logits(value: float | None) -> str:
    return "None" if value is None else f"{value:.3f}"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} MiB"


def _markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {m['t_s']:.0f} | {m['requests']} | {m['api_mib']:.0f} | {m['engine_mib']:.0f} | "
        f"{m['positions_seen']} | {m['window_positions']} | {m.get('policy_version')} | "
        f"{m.get('bias_rows_fitted')} | {_logits(m.get('bias_max_change'))} |"
        for m in result["memory"]
    )
    full_at = result["window_full_at_s"]
    after_full = _mib(result["api_growth_after_window_full_mib_per_1000_requests"])
    return (
        f"# Soak\n\n`{meta['command']}` on {meta['machine']} ({meta['cpu_count']} CPUs), "
        f"{meta['timestamp']}\n\n"
        f"| streams | seconds | requests | completed | failed | garbled | cancelled | tokens/s |\n"
        f"|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {result['streams']} | {result['seconds']:.0f} | {result['requests']} | "
        f"{result['completed']} | {result['failed']} | {result['garbled']} | "
        f"{result['cancelled']} | {result['tokens_per_s']:.1f} |\n\n"
        f"Resident memory (MiB) from the start (after warm-up), with the online estimator's "
        f"positions seen and held, its policy version, and its online bias's rows fitted and "
        f"largest change from the calibrated bias (logits; None: the policy serves no bias):\n\n"
        f"| s | requests | API | engine core | positions seen | window | policy | bias rows "
        f"| bias change |\n"
        f"|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{rows}\n\n"
        f"Growth middle → end per 1 000 requests: API "
        f"{_mib(result['api_growth_mib_per_1000_requests'])}, engine core "
        f"{_mib(result['engine_growth_mib_per_1000_requests'])}\n\n"
        + (
            f"Estimator window full at {full_at:.0f} s; API growth from then to the end per "
            f"1 000 requests: {after_full}\n"
            if full_at is not None
            else "The estimator's window did not fill during the run.\n"
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=64, help="concurrent clients")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per choice")
    parser.add_argument(
        "--sample-every", type=float, default=60.0, help="seconds between memory samples"
    )
    parser.add_argument("--tiny", action="store_true", help="serve the tiny random Llama pair")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--url", help="soak this running server instead (its key: soak-key)")
    parser.add_argument("--api-pid", type=int, help="with --url: the server's process id")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.url and args.api_pid is None:
        parser.error("--url needs --api-pid (whose memory to watch)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with _server(args) as (url, pid):
        result = asyncio.run(_soak(args, url, pid))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    meta = {
        "command": "benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "timestamp": stamp,
    }
    markdown = _markdown(result, meta)
    print(markdown)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"soak-{stamp}.json").write_text(
        json.dumps({"meta": meta, **result}, indent=2) + "\n"
    )
    (args.output_dir / f"soak-{stamp}.md").write_text(markdown)


if __name__ == "__main__":
    main()
