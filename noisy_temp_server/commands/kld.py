"""`noisy-temp-server kld`: the KL scoreboard of a clean/served pair, offline.

    noisy-temp-server kld [--served DIR | --spec SPEC] [--clean PATH]
        [--profile PROFILE [--rule RULE] | --t T] [--prompts FILE] [--num-prompts N]
        [--max-new-tokens N] [--seed N] [--device DEV] [--served-weights auto|packed|float]
        [--json] [--out FILE]

What it scores and how: `calibration.kld_report` (the shipped prompts by default). Without
`--served`/`--spec` the pair is serve's default one (the embedded model with
DEFAULT_PERTURBATION, in memory).

Prints a table (or the JSON with `--json`), writes the JSON to `--out`, and reports scored
tokens per second (both forward passes and the statistics). Returns 0, or 1 with what is wrong
on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from noisy_temp_server.commands.calibrate import add_served_weights_argument
from noisy_temp_server.commands.perturb import clean_folder, read_spec_argument
from noisy_temp_server.files import write_atomically
from noisy_temp_server.temperature.rules import Rule

__all__ = ["HELP", "add_arguments", "run"]

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
    add_served_weights_argument(parser)
    parser.add_argument(
        "--served-rows",
        choices=("auto", "model", "engine"),
        default="auto",
        help="where the served rows come from: the served model's forward (transformers), "
        "vLLM's engine serving the --served folder, which samples the completions and gives "
        "their rows, or auto: the engine for W8A8 int8, whose kernels transformers does not "
        "reproduce, unless the profile serves an adapter",
    )
    parser.add_argument(
        "--greedy-tokens",
        type=int,
        default=16,
        help="with a profile naming an adapter: greedy answers of this many tokens compared "
        "with the clean model's, per layer of the stack (0: not measured)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from noisy_temp_server.calibration.kld_report import KldRequest, kld_report  # noqa: PLC0415
    from noisy_temp_server.calibration.prompts import load_prompts  # noqa: PLC0415
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.settings import DEFAULT_PERTURBATION  # noqa: PLC0415

    try:
        spec = None if args.served else read_spec_argument(args.spec or DEFAULT_PERTURBATION)
        report = kld_report(
            KldRequest(
                clean=clean_folder(args.clean, args.cache_dir),
                prompts=load_prompts(args.prompts)[: args.num_prompts],
                served=args.served,
                spec=spec,
                profile=args.profile,
                rule=args.rule,
                t=args.t,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed,
                greedy_tokens=args.greedy_tokens,
                device=args.device,
                cache_dir=args.cache_dir,
                served_weights=args.served_weights,
                served_rows=args.served_rows,
            )
        )
    except (CorruptCheckpointError, ValueError) as error:  # input errors are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.out is not None:
        write_atomically(args.out, (report.to_json() + "\n").encode())
    print(report.to_json() if args.json else report.to_text())
    return 0
