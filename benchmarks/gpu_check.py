"""The per-step path of the T* processor on a device, checked without vLLM in one short run.

For every rule (`gpu_check_parts.step.POLICIES`: the table rules, ``schedule``, ``fisher``, a
calibrated table over the entropy), every correction (none, a per-token bias) and every batch
and vocabulary asked for, the real step objects (`gpu_check_parts.step`) run a
few steps on the device and on the CPU from the same served logits:

- correctness: the device's logits equal the CPU's within `TOLERANCE` (NaN and ±inf where the
  CPU has them), and so do what the step delivers to the host (per-request summaries, traces,
  captured rows, the bad-row count, the histogram's count and sum); on CUDA every step runs
  under ``torch.cuda.set_sync_debug_mode("error")``, so a synchronising call fails its case;
- cost: per step, the device time (CUDA events; on a CPU, wall time) and the host time of the
  step against the bare division ``logits / T`` on the same tensor (and the bare bias add), and
  the physical limit: one read and one write of the ``[B, V]`` float32
  logits at the device's measured copy bandwidth;
- goals (`GOALS`), evaluated at batch 256 and vocabulary 128 256 when measured.

Then the compensation adapter's device work at an 8B Llama's shapes (`gpu_check_parts.adapter`): the
decode cost of one block's linear layers with an unmerged LoRA adapter against none (the folded
adapter's cost), and the ``propagated`` fit of one block's projections (seconds, peak memory,
the CPU's delta). The step check stops at `STEP_SHARE` of ``--budget-s``, the fit at all of it.

One JSON file holds it all, rewritten after each part (``--out``; docs/gpu.md explains each
field). From the repository root, on the GPU machine (PyTorch, numpy, prometheus-client and
safetensors; no vLLM; nothing installed: the script finds the package beside it):

    python benchmarks/gpu_check.py --device cuda --out gpu_check.json

and in CI on a CPU, small sizes: ``--device cpu --quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # the checkout's package, installed or not
    sys.path.insert(0, _ROOT)

from gpu_check_parts.adapter import (  # noqa: E402
    FULL_SIZES,
    QUICK_SIZES,
    check_fit,
    check_lora_decode,
)
from gpu_check_parts.step import (  # noqa: E402 (after the package's folder is on the path)
    CORRECTIONS,
    POLICIES,
    STEPS,
    TABLE_RULES,
    Correction,
    StepHarness,
    served_logits,
)
from gpu_check_parts.timing import synchronize, timed  # noqa: E402

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
"""|device - cpu| <= atol + rtol |cpu| for every logit and every T* quantity delivered."""
GOAL_SIZE = (256, 128_256)
GOALS = {
    "host_us_per_step": 50.0,
    "step_over_divide": 1.5,
    "reading_step_over_divide": 2.5,
}
"""At `GOAL_SIZE`, every correction, traced and captured slots included: host µs per step of every
rule, and device time over the bare division of the rules that read the step alone
(`STEP_RULES`) and of those that read the served row (`READING_RULES`)."""
STEP_RULES = (*TABLE_RULES, "schedule")
READING_RULES = ("fisher", "calibrated_entropy")
FULL = {"batches": (1, 64, 256), "vocabs": (49_152, 128_256, 151_936), "repeats": 20}
QUICK = {"batches": (1, 8), "vocabs": (1_000, 3_001), "repeats": 3}
_FUSED_STEP = {"auto": None, "on": True, "off": False}
PIPELINED_STEPS = 10
"""Steps run back to back for ``quiet_step_pipelined_us``."""
STEP_SHARE = 0.6
"""The share of ``--budget-s`` after which the step check skips what is left (the fit gets the
rest)."""
_STARTED = time.perf_counter()  # the budget counts from the script's start
_LONG_INTERVAL_S = 3600.0  # the correctness harness's reporter delivers only at close


@contextlib.contextmanager
def _no_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, any synchronising call inside raises (``set_sync_debug_mode("error")``)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _close(got: Any, want: Any) -> bool:
    return bool(np.allclose(got, want, equal_nan=True, **TOLERANCE))


def _logits_error(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    """(within `TOLERANCE` with NaN and ±inf where ``want`` has them, max |got - want| over the
    finite entries), computed on ``got``'s device."""
    want = want.to(got.device)
    close = bool(torch.isclose(got, want, equal_nan=True, **TOLERANCE).all())
    finite = want.isfinite() & got.isfinite()
    error = torch.where(finite, (got - want).abs(), 0.0).max()
    return close, float(error)


def _compare_delivered(got: dict[str, Any], want: dict[str, Any]) -> dict[str, bool]:
    """Whether each part of what the device's step delivered matches the CPU's."""

    def same_ids(a: list[Any], b: list[Any], width: int) -> bool:
        return [r[:width] for r in a] == [r[:width] for r in b]

    summaries, traces = got["summaries"], got["traces"]
    return {
        "state": _close(got["state"], want["state"]),
        "summaries": same_ids(summaries, want["summaries"], 2)
        and [r[3] for r in summaries] == [r[3] for r in want["summaries"]]
        and _close([r[2:] for r in summaries], [r[2:] for r in want["summaries"]]),
        "traces": same_ids(traces, want["traces"], 2)
        and _close([r[2] for r in traces], [r[2] for r in want["traces"]]),
        "captured_rows": [r for r, _ in got["rows"]] == [r for r, _ in want["rows"]]
        and all(
            np.array_equal(a, b, equal_nan=True)
            for (_, a), (_, b) in zip(got["rows"], want["rows"], strict=True)
        ),
        "bad_rows": got["bad_rows"] == want["bad_rows"],
        "histogram": got["histogram"]["count"] == want["histogram"]["count"]
        and _close(got["histogram"]["sum"], want["histogram"]["sum"]),
    }


def check_case(
    rule: str,
    correction: str,
    served: torch.Tensor,
    fixture: Correction,
    device: torch.device,
    *,
    fused_step: bool | None,
    programs: int | None = None,
) -> dict[str, Any]:
    """Run `STEPS` on ``device`` (``fused_step``, ``programs``: its `StepHarness`'s) and on the
    CPU (the torch path) from ``served`` [B, V] and compare."""
    batch, vocab = served.shape
    policy = fixture.policy(POLICIES[rule], correction)
    harnesses = [
        StepHarness(
            policy,
            batch,
            vocab,
            where,
            corrections=fixture.source(),
            report_interval_s=_LONG_INTERVAL_S,
            fused_step=fused,
            programs=programs,
        )
        for where, fused in ((torch.device("cpu"), False), (device, fused_step))
    ]
    reference, tested = harnesses
    want, got = served.clone(), served.to(device, copy=True)
    served_on_device = got.clone()
    result: dict[str, Any] = {"rule": rule, "correction": correction, "batch": batch}
    result |= {"vocab": vocab, "sync_error": None, "max_abs_error": 0.0, "logits_close": True}
    for step in STEPS:
        want.copy_(served)
        got.copy_(served_on_device)
        all_rows_tuned = step != STEPS[1]  # the middle step checks each row's slot
        reference.step(want, *reference.keys(step), all_rows_tuned=all_rows_tuned)
        keys, steps = tested.keys(step)
        try:
            with _no_sync(device), torch.inference_mode():  # as vLLM runs its sampler
                tested.step(got, keys, steps, all_rows_tuned=all_rows_tuned)
        except RuntimeError as error:
            result["sync_error"] = str(error).splitlines()[0]
            break
        close, worst = _logits_error(got, want)
        result["logits_close"] &= close
        result["max_abs_error"] = max(result["max_abs_error"], worst)
    for harness in harnesses:
        harness.close()
    delivered = _compare_delivered(tested.delivered(), reference.delivered())
    result["delivered"] = delivered
    result["passed"] = (
        result["sync_error"] is None and result["logits_close"] and all(delivered.values())
    )
    return result


def copy_bandwidth_gb_s(device: torch.device) -> float:
    """The device's copy bandwidth (GB/s, read + write counted) of a 256 MiB ``copy_`` (on a
    CPU, 32 MiB)."""
    source = torch.ones((64 if device.type == "cuda" else 8) << 20, device=device)
    target = torch.empty_like(source)
    seconds, _ = timed(lambda: target.copy_(source), lambda: None, device, 10)
    return 2 * source.numel() * 4 / (seconds * 1e-6) / 1e9


def _step_times(
    harness: StepHarness,
    source: torch.Tensor,
    device: torch.device,
    repeats: int,
    *,
    back_to_back: int = 1,
) -> tuple[float, float]:
    """(device µs, host µs) per step of ``harness``'s step on fresh copies of ``source``:
    ``back_to_back`` steps timed together, so that from two on the host launches a step while
    the device still runs the one before (as in serving)."""
    logits = source.clone()
    keys, steps = harness.keys(STEPS[1])

    def run() -> None:
        for _ in range(back_to_back):
            harness.step(logits, keys, steps)

    with torch.inference_mode():
        device_us, host_us = timed(run, lambda: logits.copy_(source), device, repeats)
    return device_us / back_to_back, host_us / back_to_back


def measure_cost(
    rule: str,
    correction: str,
    served: torch.Tensor,
    fixture: Correction,
    device: torch.device,
    *,
    repeats: int,
    bandwidth_gb_s: float,
    fused_step: bool | None,
    programs: int | None = None,
) -> dict[str, Any]:
    """The step's device and host time at ``served``'s size against the bare arithmetic, with
    the reporter thread running as in the engine: with the harness's traced and captured
    slots, and ``quiet`` with none (most of live traffic)."""
    batch, vocab = served.shape
    policy = fixture.policy(POLICIES[rule], correction)
    source = served.to(device)

    def step_times(*, observed: bool, back_to_back: int = 1) -> tuple[float, float]:
        harness = StepHarness(
            policy,
            batch,
            vocab,
            device,
            corrections=fixture.source(),
            report_interval_s=0.02,
            fused_step=fused_step,
            programs=programs,
            observed=observed,
        )
        try:
            return _step_times(harness, source, device, repeats, back_to_back=back_to_back)
        finally:
            harness.close()

    step, quiet = step_times(observed=True), step_times(observed=False)
    pipelined, _ = step_times(observed=False, back_to_back=PIPELINED_STEPS)
    logits = source.clone()

    def reset() -> None:
        logits.copy_(source)

    with torch.inference_mode():
        column = torch.full((batch, 1), 1.3, device=device)
        divide = timed(lambda: logits.div_(column), reset, device, repeats)
        bias = fixture.bias.to(device)
        add = timed(lambda: logits.add_(bias), reset, device, repeats)
    limit_us = 2 * batch * vocab * 4 / (bandwidth_gb_s * 1e9) * 1e6
    result = {"rule": rule, "correction": correction, "batch": batch, "vocab": vocab}
    result |= {"step_device_us": step[0], "step_host_us": step[1]}
    result |= {"quiet_step_device_us": quiet[0], "quiet_step_host_us": quiet[1]}
    result |= {"quiet_step_pipelined_us": pipelined}
    result |= {"divide_device_us": divide[0], "divide_host_us": divide[1]}
    result |= {"add_device_us": add[0], "limit_us": limit_us}
    result |= {"step_over_divide": step[0] / divide[0]}
    return {
        key: round(value, 3) if isinstance(value, float) else value for key, value in result.items()
    }


def _goal(name: str, rows: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """The worst ``field`` of ``rows`` (the goal's cases at `GOAL_SIZE`) against its target."""
    target = GOALS[name]
    if not rows:
        return {"name": name, "target": target, "measured": None, "passed": None}
    worst = max(rows, key=lambda row: row[field])
    measured = worst[field]
    return {
        "name": name,
        "target": target,
        "measured": measured,
        "worst_rule": worst["rule"],
        "passed": measured <= target,
    }


def evaluate_goals(
    cost: list[dict[str, Any]], correctness: dict[str, Any], device: torch.device
) -> list[dict[str, Any]]:
    """`GOALS` from the measured cost (None where `GOAL_SIZE` was not measured), and no
    synchronising call in any step (None on a CPU, where nothing can tell)."""
    at_goal = [row for row in cost if (row["batch"], row["vocab"]) == GOAL_SIZE]
    step_only = [row for row in at_goal if row["rule"] in STEP_RULES]
    reading = [row for row in at_goal if row["rule"] in READING_RULES]
    synced = [case for case in correctness["cases"] if case.get("sync_error")]
    no_sync = None if device.type != "cuda" else not synced
    return [
        {"name": "no_synchronising_call", "target": 0, "measured": len(synced), "passed": no_sync},
        _goal("host_us_per_step", at_goal, "step_host_us"),
        _goal("step_over_divide", step_only, "step_over_divide"),
        _goal("reading_step_over_divide", reading, "step_over_divide"),
    ]


def _sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every (batch, vocab) asked for, the goal size first (timings there matter most)."""
    sizes = [(batch, vocab) for vocab in args.vocabs for batch in args.batches]
    return sorted(sizes, key=lambda size: size != GOAL_SIZE)


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    triton = _triton_version()
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "fused_step": args.fused_step,
        "programs": args.programs,
        "triton": triton,
        "fused_kernel_used": args.fused_step is True
        or (args.fused_step is None and cuda and triton is not None),
        "command": " ".join(sys.argv),
        "batches": list(args.batches),
        "vocabs": list(args.vocabs),
        "repeats": args.repeats,
        "steps": list(STEPS),
        "tolerance": TOLERANCE,
    }


def check_step(args: argparse.Namespace, device: torch.device, deadline: float) -> dict[str, Any]:
    """Correctness at every size, then the cost (the goal size first), until ``deadline`` (a
    `time.perf_counter` reading): a case past it is listed as skipped, and the results say so."""
    generator = torch.Generator().manual_seed(args.seed)
    fixtures = {v: Correction.random(v, generator) for v in args.vocabs}
    cases = [(rule, correction) for rule in POLICIES for correction in CORRECTIONS]
    correctness: dict[str, Any] = {"cases": [], "skipped": 0}
    cost: list[dict[str, Any]] = []
    bandwidth = copy_bandwidth_gb_s(device)
    first = _sizes(args)[0]
    warm_up = check_warm_up(served_logits(*first, generator), fixtures[first[1]], device, args)
    for phase in ("correctness",) if args.correctness_only else ("correctness", "cost"):
        for batch, vocab in _sizes(args):
            served = served_logits(batch, vocab, generator)
            for rule, correction in cases:
                if time.perf_counter() > deadline:
                    correctness["skipped"] += phase == "correctness"
                    continue
                if phase == "correctness":
                    case = check_case(
                        rule,
                        correction,
                        served,
                        fixtures[vocab],
                        device,
                        fused_step=args.fused_step,
                        programs=args.programs,
                    )
                    correctness["cases"].append(case)
                else:
                    row = measure_cost(
                        rule,
                        correction,
                        served,
                        fixtures[vocab],
                        device,
                        repeats=args.repeats,
                        bandwidth_gb_s=bandwidth,
                        fused_step=args.fused_step,
                        programs=args.programs,
                    )
                    cost.append(row)
            _progress(f"{phase} B={batch} V={vocab}")
    correctness["passed"] = not correctness["skipped"] and all(
        case["passed"] for case in correctness["cases"]
    )
    return {
        "copy_bandwidth_gb_s": round(bandwidth, 1),
        "warm_up": warm_up,
        "correctness": correctness,
        "cost": cost,
        "cost_complete": not args.correctness_only and len(cost) == len(cases) * len(_sizes(args)),
        "goals": evaluate_goals(cost, correctness, device),
    }


def check_warm_up(
    served: torch.Tensor, fixture: Correction, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """The first steps of a fresh processor (``fisher`` with a bias: every kernel the fused step
    launches), before any other in this process: its construction's seconds, which include the
    fused step's warm-up (on CUDA), the host time of its first two steps, which should not
    differ by a compilation, and how many kernel variants the warm-up and then the steps
    compiled (the steps: none)."""
    batch, vocab = served.shape
    started = time.perf_counter()
    before = _compiled_variants()
    harness = StepHarness(
        fixture.policy(POLICIES["fisher"], "bias"),
        batch,
        vocab,
        device,
        corrections=fixture.source(),
        report_interval_s=_LONG_INTERVAL_S,
        fused_step=args.fused_step,
        programs=args.programs,
    )
    result: dict[str, Any] = {"rule": "fisher", "correction": "bias", "batch": batch}
    result |= {"vocab": vocab, "construction_s": round(time.perf_counter() - started, 3)}
    after_warm_up = _compiled_variants()
    logits = served.to(device)
    keys, steps = harness.keys(STEPS[0])
    for name in ("first_step_host_us", "second_step_host_us"):
        synchronize(device)
        started = time.perf_counter()
        with torch.inference_mode():
            harness.step(logits, keys, steps)
        result[name] = round((time.perf_counter() - started) * 1e6, 1)
    counts = [before, after_warm_up, _compiled_variants()]
    known = None not in counts
    result["variants_compiled_at_warm_up"] = counts[1] - counts[0] if known else None
    result["variants_compiled_by_the_steps"] = counts[2] - counts[1] if known else None
    fused = harness.tuning.fused_step
    launchers = () if fused is None else (fused.step_launch, fused.moments_launch)
    result["direct_launch_variants"] = sum(launcher.direct_variants for launcher in launchers)
    harness.close()
    _progress("warm-up")
    return result


def _compiled_variants() -> int | None:
    """How many variants of the fused kernels this process has compiled (Triton's per-device
    caches); None where they are not compiled (Triton's interpreter, no Triton)."""
    try:
        from noisy_temp_server.step import fused_kernels  # noqa: PLC0415
    except ImportError:
        return None
    kernels = (fused_kernels.step_kernel, fused_kernels.moments_kernel)
    if not all(hasattr(kernel, "device_caches") for kernel in kernels):
        return None
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


def _progress(what: str) -> None:
    print(f"{what}: {time.perf_counter() - _STARTED:.0f} s", file=sys.stderr, flush=True)


def _passed(results: dict[str, Any]) -> bool:
    """Correctness passed, no measured goal failed, and the adapter's device work matched."""
    adapter = results["adapter"]
    return (
        results["correctness"]["passed"]
        and all(goal["passed"] is not False for goal in results["goals"])
        and adapter["lora_decode"]["folding"]["matches"]
        and not adapter["fit"]["skipped"]
        and adapter["fit"]["cpu_comparison"]["matches_cpu"]
    )


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The adapter's decode cost, the step check until `STEP_SHARE` of ``budget_s``, then the
    adapter's fit until ``budget_s``; ``save`` gets the results so far after each part."""
    device = torch.device(args.device)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    results: dict[str, Any] = {"meta": _meta(args, device)}
    results["adapter"] = {
        "lora_decode": check_lora_decode(
            sizes.shape,
            ranks=sizes.lora_ranks,
            batches=sizes.decode_batches,
            blocks=sizes.blocks,
            repeats=args.repeats,
            device=device,
        )
    }
    _progress("adapter decode cost")
    save(results)
    results |= check_step(args, device, _STARTED + STEP_SHARE * args.budget_s)
    save(results)
    results["adapter"]["fit"] = check_fit(
        sizes.shape,
        sizes.fit_rank,
        sizes.fit_tokens,
        device,
        seed=args.seed,
        deadline=_STARTED + args.budget_s,
    )
    _progress("adapter fit")
    results["meta"]["seconds"] = round(time.perf_counter() - _STARTED, 1)
    results["passed"] = _passed(results)
    save(results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file of results")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI on a CPU)")
    parser.add_argument("--batches", type=int, nargs="+", help="default: 1 64 256")
    parser.add_argument("--vocabs", type=int, nargs="+", help="default: 49152 128256 151936")
    parser.add_argument("--repeats", type=int, help="timed steps per measurement (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads of torch (default: torch's)")
    parser.add_argument(
        "--fused-step",
        choices=tuple(_FUSED_STEP),
        default="auto",
        help="the step of the table rules as one Triton kernel: auto (on CUDA), on (also on a "
        "CPU, with TRITON_INTERPRET=1), off",
    )
    parser.add_argument(
        "--programs",
        type=int,
        help="the fused step splits rows into chunks below this many rows (default: two per "
        "multiprocessor on CUDA, none on a CPU)",
    )
    parser.add_argument(
        "--correctness-only",
        action="store_true",
        help="skip the step's cost (in Triton's interpreter it says nothing)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="skip what is left after this many seconds"
    )
    args = parser.parse_args(argv)
    args.fused_step = _FUSED_STEP[args.fused_step]
    defaults = QUICK if args.quick else FULL
    args.batches = args.batches or defaults["batches"]
    args.vocabs = args.vocabs or defaults["vocabs"]
    args.repeats = args.repeats or defaults["repeats"]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check, write ``--out``; exit status 0 when correctness and every measured goal
    passed, 1 otherwise."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def save(results: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    results = run(args, save)
    summary = {goal["name"]: goal["passed"] for goal in results["goals"]}
    print(json.dumps({"correctness": results["correctness"]["passed"], **summary}))
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
