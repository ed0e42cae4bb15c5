"""The compensation adapter's fit methods side by side, on the same pair, rank and prompts.

The served model samples completions (T = 1) of the fit prompts (the first ``--fit-prompts``
shipped calibration prompts; as many per prompt as the largest of ``--completions``) and one per
test prompt (``--test-prompts``, by default the 24 formal prompts of another domain). Each
method of ``--methods`` (``method:ridge``, e.g. ``eora:0.001`` or ``propagated:10``) fits a
rank-``--rank`` adapter on the first K completions of each fit prompt, for each K of
``--completions`` (`adapter.layer_fit.fit_compensation_adapter`), and the served model with it
is scored against the clean one at T = 1 on the test sequences. Reported per method: the fit's wall
time, mean KL(clean || served + adapter), the share of KL(T = 1) removed with its
prompt-clustered standard error, and the paired difference in that share to every method
listed before it (positive: this one removes more), clustered the same way. A row is
``method:ridge``, or ``method:ridge ×K`` where K is not 1.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice .venv/bin/python experiments/adapter_methods.py \\
        --spec '{"kind": "quantization", "format": "int4", "group_size": 128}' --rank 16 \\
        --methods eora:0.001,propagated:10 --out experiments/results/adapter_methods
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, cast, get_args

import torch

from noisy_temp_server.adapter.layer_fit import AdapterMethod, fit_compensation_adapter
from noisy_temp_server.calibration.adapter_calibration import adapter_kl_records
from noisy_temp_server.calibration.completions import sample_completions
from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.checkpoints.perturbation import parse_spec
from noisy_temp_server.commands.perturb import clean_folder
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.scoring.standard_error import cluster_stderr

REPOSITORY = Path(__file__).resolve().parents[1]
FORMAL_PROMPTS = REPOSITORY / "benchmarks" / "data" / "prompts_formal.jsonl"


def _shown(path: Path) -> str:
    """`path` relative to the repository where it lies inside it (results name no machine)."""
    resolved = path.resolve()
    return (
        str(resolved.relative_to(REPOSITORY)) if resolved.is_relative_to(REPOSITORY) else str(path)
    )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="perturbation spec (JSON)")
    parser.add_argument("--clean", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--methods", default="eora:0.001,propagated:10")
    parser.add_argument("--fit-prompts", type=int, default=40)
    parser.add_argument(
        "--completions", default="1", help="completions per fit prompt to fit on, e.g. 1,4"
    )
    parser.add_argument("--test-prompts", type=Path, default=FORMAL_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True, help="folder for result.json/.md")
    return parser.parse_args()


def _methods(text: str) -> list[tuple[AdapterMethod, float]]:
    """[(method, ridge)] from ``method:ridge,...``; ValueError for a malformed entry."""
    methods = []
    for entry in text.split(","):
        method, _, ridge = entry.partition(":")
        if method not in get_args(AdapterMethod) or (method != "svd" and not ridge):
            raise ValueError(f"--methods entry {entry!r}: expected eora:R, propagated:R or svd")
        methods.append((cast("AdapterMethod", method), float(ridge or 1.0)))
    return methods


def _completion_counts(text: str) -> list[int]:
    """[K, ...] from ``K,...``; ValueError unless each is a distinct whole number >= 1."""
    entries = [entry.strip() for entry in text.split(",")]
    counts = [int(entry) if entry.isascii() and entry.isdecimal() else 0 for entry in entries]
    if not all(counts) or len(set(counts)) != len(counts):
        raise ValueError(f"--completions {text!r}: expected distinct whole numbers >= 1, e.g. 1,4")
    return counts


def _fit_seed(completion: int) -> int:
    """The sampling seed of each fit prompt's completion number `completion` (0, 1, ...):
    0, then 2, 3, ... (seed 1 samples the test prompts)."""
    return 0 if completion == 0 else completion + 1


def _kl(pair: LoadedPair, sequences: list[ScoringSequence], adapter: Any) -> tuple[Any, Any]:
    records = adapter_kl_records(pair, sequences, adapter, "cpu")
    return records.kl_at_one.double(), records.sequence_id


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    clean = clean_folder(args.clean, None)
    pair = load_pair(clean, spec=parse_spec(args.spec))
    counts = _completion_counts(args.completions)
    fit_prompts = load_prompts()[: args.fit_prompts]
    samples = [
        sample_completions(
            pair, fit_prompts, max_new_tokens=args.max_new_tokens, seed=_fit_seed(completion)
        )
        for completion in range(max(counts))
    ]
    test = sample_completions(
        pair, load_prompts(args.test_prompts), max_new_tokens=args.max_new_tokens, seed=1
    )
    base, ids = _kl(pair, test, None)
    kl_one = float(base.mean())
    rows: list[dict[str, Any]] = []
    kept: dict[str, Any] = {}
    for (method, ridge), count in itertools.product(_methods(args.methods), counts):
        label = f"{method}:{ridge:g}" + ("" if count == 1 else f" ×{count}")
        fit = [sequence for sample in samples[:count] for sequence in sample]
        started = time.monotonic()
        adapter = fit_compensation_adapter(
            pair.clean_model, pair.served_model, fit, rank=args.rank, method=method, ridge=ridge
        )
        seconds = time.monotonic() - started
        kl, _ = _kl(pair, test, adapter)
        versus = {
            other: {
                "share_difference": float((earlier - kl).mean()) / kl_one,
                "stderr": cluster_stderr(earlier - kl, ids) / kl_one,
            }
            for other, earlier in kept.items()
        }
        kept[label] = kl
        rows.append(
            {
                "method": label,
                "fit_seconds": seconds,
                "kl": float(kl.mean()),
                "share_removed": float((base - kl).mean()) / kl_one,
                "stderr": cluster_stderr(base - kl, ids) / kl_one,
                "versus": versus,
            }
        )
        print(_row_text(rows[-1]), flush=True)
    return {
        "spec": json.loads(args.spec),
        "rank": args.rank,
        "fit_prompts": args.fit_prompts,
        "completions_per_fit_prompt": counts,
        "fit_tokens_per_completion": sum(len(s.token_ids) for s in samples[0]),
        "test_prompts": _shown(args.test_prompts),
        "test_positions": len(base),
        "max_new_tokens": args.max_new_tokens,
        "kl_at_one": kl_one,
        "methods": rows,
    }


def _row_text(row: dict[str, Any]) -> str:
    versus = "; ".join(
        f"vs {other} {100 * d['share_difference']:+.2f} % ± {100 * d['stderr']:.2f}"
        for other, d in row["versus"].items()
    )
    return (
        f"| {row['method']} | {row['fit_seconds']:.0f} | {1e3 * row['kl']:.1f} "
        f"| {100 * row['share_removed']:.1f} % ± {100 * row['stderr']:.1f} | {versus} |"
    )


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Adapter fit methods, rank {result['rank']}, {json.dumps(result['spec'])}",
        "",
        f"Fit: {result['fit_prompts']} shipped prompts, one completion each "
        f"({result['fit_tokens_per_completion']} tokens; K each in the rows marked ×K); test: "
        f"{result['test_prompts']} ({result['test_positions']} positions), completions of up "
        f"to {result['max_new_tokens']} tokens sampled by the served model; KL(T = 1) "
        f"{1e3 * result['kl_at_one']:.1f} × 10⁻³ nats.",
        "",
        "| method:ridge | fit (s) | KL (1e-3) | share of KL(T=1) removed ± s.e. "
        "| paired difference in share ± s.e. |",
        "|---|---:|---:|---:|---|",
    ]
    return "\n".join(lines + [_row_text(row) for row in result["methods"]]) + "\n"


def main() -> int:
    args = _arguments()
    try:
        _methods(args.methods)
        _completion_counts(args.completions)
        parse_spec(args.spec)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    result = _measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "result.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
