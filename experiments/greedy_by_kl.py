"""Greedy agreement with the clean model against KL(clean || served) at T = 1, per perturbation
family, without any correction: how low the KL must be for greedy answers to agree for long.

    .venv/bin/python experiments/greedy_by_kl.py [--families int8 fp8 noise-0.02 ...]
        [--prompts benchmarks/data/prompts_formal.jsonl] [--max-new-tokens 64]
        [--greedy-tokens 64] [--threads N] [--out DIR]

For each family (the names of `benchmarks/quality.py`): the served model samples one completion
per prompt; the mean KL at T = 1 over their positions; then greedy answers of both models from
each prompt and the tokens before the first difference (`scoring.greedy`). Prints a markdown
table and writes it, with JSON, to DIR/greedy_by_kl.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # quality.py

from quality import FAMILIES

from noisy_temp_server.calibration.adapter_calibration import adapter_kl_records
from noisy_temp_server.calibration.completions import sample_completions
from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import load_pair
from noisy_temp_server.scoring.greedy import greedy_agreement
from noisy_temp_server.scoring.sampling import eos_ids
from noisy_temp_server.settings import Settings

HERE = Path(__file__).resolve().parent
FORMAL = HERE.parent / "benchmarks" / "data" / "prompts_formal.jsonl"
RESULTS = HERE / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=["int8", "fp8"])
    parser.add_argument("--prompts", type=Path, default=FORMAL)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clean_path = ensure_default_model(Settings().cache_dir)
    prompts = load_prompts(args.prompts)
    rows = []
    lines = [
        f"# Greedy agreement against KL at T = 1 ({len(prompts)} prompts of {args.prompts.name}, "
        f"greedy answers of {args.greedy_tokens} tokens, no correction)",
        "",
        "| family | KL(T = 1) (1e-3) | greedy tokens before divergence | exact answers |",
        "|---|---:|---:|---:|",
    ]
    for family in args.families:
        started = time.monotonic()
        pair = load_pair(clean_path, spec=FAMILIES[family])
        if pair.served_model is pair.clean_model:
            print(f"{family}: serves the clean weights; greedy agreement is complete, skipped")
            continue
        sequences = sample_completions(pair, prompts, max_new_tokens=args.max_new_tokens, seed=0)
        kl = adapter_kl_records(pair, sequences, None, "cpu").kl_at_one
        mean_kl = float(kl[torch.isfinite(kl)].double().mean())
        agreement = greedy_agreement(
            pair.clean_model,
            pair.served_model,
            [s.token_ids[: s.prompt_length] for s in sequences],
            max_new_tokens=args.greedy_tokens,
            eos_ids=eos_ids(pair.served_model),
        )
        rows.append(
            {
                "family": family,
                "kl_at_one": mean_kl,
                "greedy_tokens": agreement.mean_agreed_tokens,
                "greedy_tokens_stderr": agreement.agreed_stderr,
                "exact_rate": agreement.exact_match_rate,
                "seconds": time.monotonic() - started,
            }
        )
        lines.append(
            f"| {family} | {1e3 * mean_kl:.1f} | {agreement.mean_agreed_tokens:.2f} ± "
            f"{agreement.agreed_stderr:.2f} | {100 * agreement.exact_match_rate:.1f} % |"
        )
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "greedy_by_kl.md").write_text("\n".join(lines) + "\n")
    (args.out / "greedy_by_kl.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
