"""`noisy-temp-server kld`: the KL scoreboard of a clean/served pair, offline.

    noisy-temp-server kld [--served DIR | --spec SPEC] [--clean PATH]
        [--profile PROFILE [--rule RULE] | --t T] [--prompts FILE] [--num-prompts N]
        [--max-new-tokens N] [--seed N] [--device DEV] [--json] [--out FILE]

The served model samples one completion per prompt at T = 1, as `calibrate` does (default: the
shipped prompts); both models then score prompt + completion teacher-forced, a chunk of
positions at a time, and `noisy_temp_server.scoring.scoreboard` accumulates llama.cpp's
statistics (mean KLD ± SE, KLD percentiles, same-top-token rate, Δp of the clean top token,
PPL ratio) for the served model at T = 1 and as served: the profile's recommended policy (or
`--rule`) with `--profile`, a fixed T with `--t`, else T* = 1. When the profile recommends its
per-token bias b, "served" is softmax((z~ + b) / T*) with the vector from beside the profile.
With a profile whose compensation adapter is recommended (`calibrate --adapter-rank`), the
served model samples and is scored with the adapter (from beside the profile), and the table
has one column per layer of the stack (`calibration.stack`): the served model at T = 1, the
adapter alone, adapter + T, adapter + bias + T, each with its share of KL(T = 1) removed and its
greedy agreement with the clean model (`--greedy-tokens`).
Without `--served`/`--spec` the pair is serve's default one (the embedded model with
DEFAULT_PERTURBATION, in memory).
The continuations are the served model's own samples (llama.cpp scores a fixed text), so the
served model tends to find them likelier than the clean one does: PPL(served)/PPL(clean) < 1
there does not mean the served model is better.

Prints a table (or the JSON with `--json`), writes the JSON to `--out`, and reports scored
tokens per second (both forward passes and the statistics). Returns 0, or 1 with what is wrong
on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from noisy_temp_server.commands.perturb import default_clean_path, read_spec_argument
from noisy_temp_server.files import write_atomically
from noisy_temp_server.temperature.rules import Rule

if TYPE_CHECKING:
    from torch import Tensor

    from noisy_temp_server.calibration.profile import Profile
    from noisy_temp_server.calibration.stack import StackReport
    from noisy_temp_server.checkpoints.loading import LoadedPair
    from noisy_temp_server.scoring.scoreboard import ScoreboardResult
    from noisy_temp_server.scoring.sequence import ScoringSequence
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = ["HELP", "add_arguments", "format_table", "run"]

HELP = "KL scoreboard of a pair (llama.cpp's KLD statistics) at T = 1 and at the served T*."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument("--served", type=Path, help="served checkpoint (perturbed or quantized)")
    pair.add_argument("--spec", help="perturbation spec applied in memory (JSON file or inline)")
    parser.add_argument(
        "--clean", type=Path, default=None, help="clean checkpoint (default: embedded SmolLM2)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the product's cache: the default model, folder identities",
    )
    served_t = parser.add_mutually_exclusive_group()
    served_t.add_argument("--profile", type=Path, help="profile giving the served T* (`calibrate`)")
    served_t.add_argument("--t", type=float, default=None, help="a fixed served T*")
    parser.add_argument(
        "--rule", choices=[r.value for r in Rule], help="profile rule (default: recommended)"
    )
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion length")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="cpu", help="torch device for generation and scoring")
    parser.add_argument(
        "--greedy-tokens",
        type=int,
        default=16,
        help="with a profile naming an adapter: greedy answers of this many tokens compared "
        "with the clean model's, per layer of the stack (0: not measured)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")


def _policy_bias(args: argparse.Namespace, policy: TemperaturePolicy) -> Tensor | None:
    """The vector of the policy's per-token bias (None when it names none), from beside the
    profile; ValueError when it cannot be read there."""
    from noisy_temp_server.correction.files import load_bias_file  # noqa: PLC0415

    if policy.bias is None:
        return None
    return load_bias_file(args.profile.parent, policy.bias)


def _policy(args: argparse.Namespace, profile: Profile | None) -> TemperaturePolicy:
    from noisy_temp_server.temperature.policy import TemperaturePolicy  # noqa: PLC0415
    from noisy_temp_server.temperature.rules import TemperatureBounds  # noqa: PLC0415

    if profile is not None:
        return profile.to_policy(args.rule)
    if args.rule is not None:
        raise ValueError("--rule picks a rule of --profile; give --profile too")
    if args.t is not None:
        if not (math.isfinite(args.t) and args.t > 0):
            raise ValueError(f"--t must be a finite number > 0, got {args.t}")
        bounds = TemperatureBounds(min(args.t, 1.0), max(args.t, 1.0))
        return TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=args.t, bounds=bounds)
    return TemperaturePolicy.identity()


def _row(label: str, values: Sequence[str], widths: Sequence[int]) -> str:
    return f"{label:<28}" + "".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True))


def format_table(results: dict[str, ScoreboardResult]) -> str:
    """llama.cpp-style text table: one column per entry of `results`, headed by its key, each
    column at least two spaces wider than its longest cell so titles never run together."""
    columns = list(results.values())
    widths = [max(24, len(label) + 2) for label in results]

    def each(render: Any) -> list[str]:
        return [render(r) for r in columns]

    def row(label: str, values: Sequence[str]) -> str:
        return _row(label, values, widths)

    lines = [
        row("", list(results)),
        "====== Perplexity statistics ======",
        row(
            "PPL(served)/PPL(clean)",
            each(lambda r: f"{r.ppl_ratio:.5f} ± {r.ppl_ratio * r.ln_ppl_ratio_stderr:.5f}"),
        ),
        row(
            "ln(PPL(served)/PPL(clean))",
            each(lambda r: f"{r.ln_ppl_ratio:.5f} ± {r.ln_ppl_ratio_stderr:.5f}"),
        ),
        "====== KL divergence statistics ======",
        row("Mean KLD", each(lambda r: f"{r.kld_mean:.6f} ± {r.kld_stderr:.6f}")),
    ]
    for level in columns[0].kld_percentiles:
        lines.append(row(f"{level}% KLD", each(lambda r, q=level: f"{r.kld_percentiles[q]:.6f}")))
    lines += [
        "====== Token probability statistics ======",
        row(
            "Mean Δp",
            each(lambda r: f"{100 * r.delta_p_mean:.3f} ± {100 * r.delta_p_stderr:.3f} %"),
        ),
    ]
    for level in columns[0].delta_p_percentiles:
        lines.append(
            row(f"{level}% Δp", each(lambda r, q=level: f"{100 * r.delta_p_percentiles[q]:.3f} %"))
        )
    lines += [
        row("RMS Δp", each(lambda r: f"{100 * r.delta_p_rms:.3f} %")),
        row(
            "Same top p",
            each(lambda r: f"{100 * r.same_top_rate:.3f} ± {100 * r.same_top_stderr:.3f} %"),
        ),
    ]
    first = columns[0]
    lines.append(
        f"{first.positions} positions in {first.sequences} sequences "
        f"({first.infinite_positions} with infinite KL left out); SE cluster-robust by sequence"
        + ("" if first.exact_percentiles else "; percentiles from a uniform sample")
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from noisy_temp_server.calibration.adapter_calibration import applied_adapter  # noqa: PLC0415
    from noisy_temp_server.calibration.completions import sample_completions  # noqa: PLC0415
    from noisy_temp_server.calibration.profile import Profile  # noqa: PLC0415
    from noisy_temp_server.calibration.prompts import load_prompts  # noqa: PLC0415
    from noisy_temp_server.calibration.served_adapter import profile_adapter  # noqa: PLC0415
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.checkpoints.loading import load_pair  # noqa: PLC0415
    from noisy_temp_server.settings import DEFAULT_PERTURBATION  # noqa: PLC0415

    try:
        clean_path = args.clean or default_clean_path(args.cache_dir)
        prompts = load_prompts(args.prompts)[: args.num_prompts]
        spec = None if args.served else read_spec_argument(args.spec or DEFAULT_PERTURBATION)
        pair = load_pair(
            clean_path, served_path=args.served, spec=spec, device=args.device,
            cache_dir=args.cache_dir,
        )  # fmt: skip
        profile = (
            None
            if args.profile is None
            else Profile.load_for_pair(args.profile, pair.clean, pair.served)
        )
        policy = _policy(args, profile)
        adapter = None if profile is None else profile_adapter(profile, args.profile.parent)
        started = time.monotonic()
        with applied_adapter(pair.served_model, adapter):  # sampled as served
            sequences = sample_completions(
                pair, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed
            )
        generated = time.monotonic()
        results, statistics, mean_t_star, stack = _score(
            args, pair, sequences, profile, policy, with_adapter=adapter is not None
        )
        scoring_seconds = time.monotonic() - generated
    except (CorruptCheckpointError, ValueError) as error:  # input errors are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 1
    first = next(iter(results.values()))
    scored = first.positions + first.infinite_positions
    report = {
        "clean": pair.clean.describe(),
        "served": pair.served.describe(),
        "policy": json.loads(policy.to_json()),
        "adapter": None if profile is None or profile.adapter is None else profile.adapter.sha256,
        "mean_t_star": mean_t_star,
        "generation_seconds": generated - started,
        "scoring_seconds": scoring_seconds,
        "scored_tokens_per_second": scored / scoring_seconds if scoring_seconds > 0 else None,
        "statistics": {label: result.to_dict() for label, result in statistics.items()},
        "stack": None if stack is None else [layer.to_dict() for layer in stack.layers],
    }
    text = json.dumps(report, indent=2, allow_nan=False, default=str)
    if args.out is not None:
        write_atomically(args.out, (text + "\n").encode())
    if args.json:
        print(text)
    else:
        _print_report(report, results, stack, scored)
    return 0


_Columns = dict[str, "ScoreboardResult"]


def _score(
    args: argparse.Namespace,
    pair: LoadedPair,
    sequences: list[ScoringSequence],
    profile: Profile | None,
    policy: TemperaturePolicy,
    *,
    with_adapter: bool,
) -> tuple[
    dict[str, ScoreboardResult], dict[str, ScoreboardResult], float | None, StackReport | None
]:
    """Score `sequences`: each layer of the stack when the profile serves an adapter, else T = 1
    against `policy` as served. Returns (the table's columns by title, every statistic by
    label, the mean T* served or None for a stack, the stack or None)."""
    from noisy_temp_server.calibration.stack import score_scoreboard, score_stack  # noqa: PLC0415

    if profile is not None and with_adapter:
        stack = score_stack(
            pair,
            sequences,
            profile,
            args.profile.parent,
            served_policy=policy,
            greedy_tokens=args.greedy_tokens,
            device=args.device,
        )
        results = {layer.label: layer.result for layer in stack.layers}
        return results, results, None, stack
    bias = _policy_bias(args, policy)
    board = score_scoreboard(pair, sequences, policy, bias=bias, device=args.device)
    by_label = board.result()
    mean_t_star = board.mean_temperature()
    with_bias = "" if policy.bias is None else " + bias"
    label = f"T* ({policy.rule.value}{with_bias}, mean {mean_t_star:.3f})"
    return {"T=1": by_label["T=1"], label: by_label["T*"]}, by_label, mean_t_star, None


def _print_report(
    report: dict[str, Any],
    results: dict[str, ScoreboardResult],
    stack: StackReport | None,
    scored: int,
) -> None:
    print(f"clean:  {report['clean']}\nserved: {report['served']}")
    print(format_table(results))
    if stack is not None:
        print(f"\nThe stack (adapter {report['adapter']}):\n")
        print(stack.to_markdown())
    print(
        f"scored {scored} tokens in {report['scoring_seconds']:.1f} s "
        f"({report['scored_tokens_per_second']:.1f} tokens/s; generation "
        f"{report['generation_seconds']:.1f} s)"
    )
