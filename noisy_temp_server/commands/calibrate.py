"""`noisy-temp-server calibrate`: fit every temperature rule on a clean/served pair.

    noisy-temp-server calibrate (--served DIR | --spec SPEC) --out PROFILE.json
        [--clean PATH] [--prompts FILE] [--num-prompts N] [--records FILE] [--report DIR]
        [--device DEV] [--served-weights auto|packed|float]
        [calibration settings: --max-new-tokens N, --adapter-rank [R], ...]

The served model samples completions for the prompts (default: the shipped set), the pair is
scored, and the prompts are split three ways: every rule is fitted on the fit split, the
validation split is halved by prompt, the calibrated table's cells are chosen on its selection
half and the recommended rule on its gate half (the lowest-KL rule whose gain over T = 1 is
material there: over 2 s.e. and 0.1 % of KL(T = 1), else `off`), and it is measured on the
test split. The per-token bias + T is fitted too, and with `--adapter-rank R` a compensation
adapter first (`calibration.adapter_calibration`), under which everything else is fitted where
it is recommended. The profile and its files are written by `calibration.run` and its quality
tables printed; `--report DIR` writes the markdown + PNG report of the four reference
experiments on the clean model (`calibration.reference_report`), and may be given alone. The
calibration settings' flags are generated from `CalibrationSettings`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from noisy_temp_server.calibration.settings import add_calibration_arguments
from noisy_temp_server.commands.perturb import clean_folder, read_spec_argument

__all__ = ["HELP", "add_arguments", "run"]

HELP = "Fit every temperature rule on a clean/served pair and write the profile (and a report)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument("--served", type=Path, help="served checkpoint (e.g. from `perturb`)")
    pair.add_argument("--spec", help="perturbation spec applied in memory (JSON file or inline)")
    parser.add_argument("--out", type=Path, help="profile file to write (JSON)")
    parser.add_argument(
        "--clean", type=Path, default=None, help="clean checkpoint (default: embedded SmolLM2)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the product's cache: the default model, folder identities",
    )
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--records", type=Path, default=None, help="save records here")
    parser.add_argument("--report", type=Path, default=None, help="write the report here")
    parser.add_argument("--device", default="cpu", help="torch device for scoring")
    add_served_weights_argument(parser)
    add_calibration_arguments(parser)


def add_served_weights_argument(parser: argparse.ArgumentParser) -> None:
    """``--served-weights``, how a quantized served model is loaded (`load_pair`'s
    ``served_weights``); `kld` takes it too."""
    parser.add_argument(
        "--served-weights",
        choices=("auto", "packed", "float"),
        default="auto",
        help="a quantized served model's weights: packed (dequantized one layer at a time, no "
        "second float copy; slower), float (whole), or auto: packed when its float copy would "
        "take over a quarter of the free memory (same results either way)",
    )


def _calibrate(args: argparse.Namespace, clean: Path) -> None:
    """Calibrate the pair the flags name and print what `calibration_text` says."""
    from noisy_temp_server.calibration.prompts import load_prompts  # noqa: PLC0415
    from noisy_temp_server.calibration.run import (  # noqa: PLC0415
        calibrate_to_files,
        calibration_text,
    )
    from noisy_temp_server.calibration.settings import (  # noqa: PLC0415
        calibration_settings_from_args,
    )

    prompts = load_prompts(args.prompts)[: args.num_prompts]
    settings = calibration_settings_from_args(args, len(prompts))
    spec = read_spec_argument(args.spec) if args.spec else None
    files = calibrate_to_files(
        clean, prompts, settings, args.out,
        served=args.served, spec=spec, device=args.device, records=args.records,
        cache_dir=args.cache_dir, served_weights=args.served_weights,
    )  # fmt: skip
    print(calibration_text(files))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pydantic import ValidationError  # noqa: PLC0415

    from noisy_temp_server.calibration.settings import settings_problems  # noqa: PLC0415
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415

    has_pair = args.served is not None or args.spec is not None
    if not has_pair and args.report is None:
        print("error: give --served or --spec (with --out), and/or --report", file=sys.stderr)
        return 1
    if has_pair and args.out is None:
        print("error: --out PROFILE.json is required to calibrate a pair", file=sys.stderr)
        return 1
    try:
        clean = clean_folder(args.clean, args.cache_dir)
        if has_pair:
            _calibrate(args, clean)
        if args.report is not None:
            from noisy_temp_server.calibration.reference_report import write_report  # noqa: PLC0415

            print(write_report(clean, args.report, device=args.device))
    except ValidationError as error:  # the settings' own checks, one line for all of them
        print(f"error: invalid calibration settings: {settings_problems(error)}", file=sys.stderr)
        return 1
    except (CorruptCheckpointError, ValueError, OSError) as error:  # input errors: ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
