"""`noisy-temp-server calibrate`: fit every temperature rule on a clean/served pair.

    noisy-temp-server calibrate (--served DIR | --spec SPEC) --out PROFILE.json
        [--clean PATH] [--prompts FILE] [--num-prompts N] [--max-new-tokens N] [--seed N]
        [--validation-fraction F] [--test-fraction F] [--bias-rows N]
        [--adapter-rank [R] [--adapter-method propagated|eora|svd]]
        [--records FILE] [--report DIR] [--device DEV]

The served model samples completions for the prompts (default: the shipped set), the pair is
scored, and the prompts are split three ways: every rule is fitted on the fit split, the
validation split is halved by prompt, the calibrated table's cells are chosen on its selection
half and the recommended rule on its gate half (the lowest-KL rule whose gain over T = 1 is
material there: over 2 s.e. and 0.1 % of KL(T = 1), else `off`), and it is measured on the
test split. The profile
(`noisy_temp_server.calibration.profile`) is written to --out and the quality tables printed,
each headed by its split and request temperatures: validation (its gate half) and test pooled
over the request
temperatures, then the test split at each. The per-token bias + T is fitted too, on the full
rows of up to `--bias-rows` positions (its table is printed); its vector is written beside the
profile (`bias-<sha256>.safetensors`), and so is the recommended policy
(`<profile stem>.policy.json`, what `NTS_POLICY_FILE` reads): the bias
with its T at each request temperature when the bias is recommended, else the recommended
rule. With `--adapter-rank R` a compensation adapter is fitted first
(`calibration.adapter_calibration`) and saved beside the profile (`adapter-<hash>/`, PEFT LoRA);
where it is recommended everything above is fitted on the served model with it. `--records`
also saves the per-position records (safetensors); `--report DIR` writes the markdown + PNG
report of the four reference experiments on the clean model
(`noisy_temp_server.calibration.reference_report`), and may be given alone.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from noisy_temp_server.commands.perturb import default_clean_path, read_spec_argument
from noisy_temp_server.files import write_atomically

if TYPE_CHECKING:
    from noisy_temp_server.calibration.adapter_calibration import AdapterCalibration
    from noisy_temp_server.calibration.bias_fit import BiasCalibration

__all__ = ["DEFAULT_ADAPTER_RANK", "HELP", "add_arguments", "run"]

DEFAULT_ADAPTER_RANK = 64
"""The rank `--adapter-rank` gives without a value (the choice is measured in docs/adapter.md)."""

HELP = "Fit every temperature rule on a clean/served pair and write the profile (and a report)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument("--served", type=Path, help="served checkpoint (e.g. from `perturb`)")
    pair.add_argument("--spec", help="perturbation spec applied in memory (JSON file or inline)")
    parser.add_argument("--out", type=Path, help="profile file to write (JSON)")
    parser.add_argument(
        "--clean", type=Path, default=None, help="clean checkpoint (default: embedded SmolLM2)"
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache of the default model")
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion length")
    parser.add_argument("--seed", type=int, default=0, help="sampling and split seed")
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=0.3,
        help="share of the prompts that choose the rule (and check the calibrated table)",
    )
    parser.add_argument(
        "--test-fraction", type=float, default=0.3, help="share of the prompts that report"
    )
    parser.add_argument(
        "--request-temperatures",
        type=_temperatures,
        default=None,
        help="comma-separated request temperatures T_r every position is measured at, one "
        "calibrated band each, 1.0 included (default: CalibrationSettings, 0.5,0.7,1.0,1.2); "
        "a recommended bias must hold against the rule at each, so traffic at T_r = 1 alone "
        "calibrates with 1.0",
    )
    parser.add_argument(
        "--bias-rows",
        type=int,
        default=None,
        help="positions whose full rows fit the per-token bias (400 KB each for a 49k "
        "vocabulary; more fit it better; 0: no bias; default: CalibrationSettings.bias_rows)",
    )
    parser.add_argument(
        "--adapter-rank",
        type=int,
        nargs="?",
        const=DEFAULT_ADAPTER_RANK,
        default=0,
        metavar="R",
        help="fit a compensation adapter of this LoRA rank first (weight-space correction of "
        "every perturbed linear layer, saved beside the profile in PEFT format); the rules and "
        f"the bias are then fitted on top of it; the flag alone: rank {DEFAULT_ADAPTER_RANK} "
        "(docs/adapter.md says why). Needs served weights that differ from the clean ones; "
        "0: none",
    )
    parser.add_argument(
        "--adapter-method",
        choices=("propagated", "eora", "svd"),
        default="propagated",
        help="adapter fit: propagated (each layer fitted to give the clean model's outputs on "
        "its inputs; default), eora (each layer's own error, weighted by its inputs) or svd "
        "(plain SVD of each error)",
    )
    parser.add_argument(
        "--adapter-fit-completions",
        type=int,
        default=1,
        metavar="K",
        help="refit the adapter, once its ridge is chosen, on K completions of each fit and "
        "selection prompt (more data: its gain and cost: docs/adapter.md; default 1)",
    )
    parser.add_argument(
        "--adapter-distil-epochs",
        type=int,
        default=0,
        help="then distil the adapter end to end on the clean model's next-token distributions "
        "for up to this many epochs, the best on the selection half kept (its gain and cost: "
        "docs/adapter.md); 0: none",
    )
    parser.add_argument(
        "--adapter-distil-completions",
        type=int,
        default=4,
        help="completions of each fit prompt the distillation trains on (default 4)",
    )
    parser.add_argument("--records", type=Path, default=None, help="save records here")
    parser.add_argument("--report", type=Path, default=None, help="write the report here")
    parser.add_argument("--device", default="cpu", help="torch device for scoring")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from pydantic import ValidationError  # noqa: PLC0415

    from noisy_temp_server.calibration.pipeline import calibrate  # noqa: PLC0415
    from noisy_temp_server.calibration.profile import (  # noqa: PLC0415
        CalibrationSettings,
        settings_problems,
    )
    from noisy_temp_server.calibration.prompts import load_prompts  # noqa: PLC0415
    from noisy_temp_server.pairs.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.pairs.loading import load_pair  # noqa: PLC0415

    has_pair = args.served is not None or args.spec is not None
    if not has_pair and args.report is None:
        print("error: give --served or --spec (with --out), and/or --report", file=sys.stderr)
        return 1
    if has_pair and args.out is None:
        print("error: --out PROFILE.json is required to calibrate a pair", file=sys.stderr)
        return 1
    try:
        clean_path = args.clean or default_clean_path(args.cache_dir)
        if has_pair:
            prompts = load_prompts(args.prompts)[: args.num_prompts]
            settings = CalibrationSettings(
                prompts=len(prompts),
                max_new_tokens=args.max_new_tokens,
                seed=args.seed,
                validation_fraction=args.validation_fraction,
                test_fraction=args.test_fraction,
                **({} if args.bias_rows is None else {"bias_rows": args.bias_rows}),
                adapter_rank=args.adapter_rank,
                adapter_method=args.adapter_method,
                adapter_fit_completions=args.adapter_fit_completions,
                adapter_distil_epochs=args.adapter_distil_epochs,
                adapter_distil_completions=args.adapter_distil_completions,
                **(
                    {}
                    if args.request_temperatures is None
                    else {"request_temperatures": args.request_temperatures}
                ),
            )
            spec = read_spec_argument(args.spec) if args.spec else None
            pair = load_pair(clean_path, served_path=args.served, spec=spec, device=args.device)
            result = calibrate(pair, prompts, settings, device=args.device)
            if result.bias is not None:  # first: a profile never names a file not yet written
                _save_correction(args.out.parent, result.bias)
            if result.adapter is not None:
                from noisy_temp_server.correction.adapter import save_peft_adapter  # noqa: PLC0415

                save_peft_adapter(args.out.parent, result.adapter.adapter)
            result.profile.save(args.out)
            policy_path = args.out.with_name(f"{args.out.stem}.policy.json")
            write_atomically(policy_path, (result.profile.to_policy().to_json() + "\n").encode())
            if args.records is not None:
                from noisy_temp_server.pairs.records import PositionRecords  # noqa: PLC0415

                parts = [result.fit, result.validation, result.test]
                PositionRecords.concat(parts).save(args.records)
            if result.adapter is not None:
                print(adapter_text(result.adapter))
            print(result.profile.validation_quality.to_markdown())
            print(result.profile.test_quality.to_markdown())
            for table in result.profile.test_quality_by_request_temperature:
                print(table.to_markdown())
            rule = result.profile.recommended_rule.value
            why = (
                "no rule's gain over T=1 on the validation gate half exceeds 2 standard errors "
                "and 0.1% of KL(T=1)"
                if rule == "off"
                else "the lowest validation KL among rules whose gain over T=1 exceeds 2 s.e. "
                "and 0.1% of KL(T=1); its test row is the figure to quote"
            )
            print(f"recommended rule: {rule} ({why}); profile: {args.out}")
            if result.bias is not None:
                print(result.bias.to_markdown())
            print(f"recommended policy (NTS_POLICY_FILE): {policy_path}")
        if args.report is not None:
            from noisy_temp_server.calibration.reference_report import write_report  # noqa: PLC0415

            print(write_report(clean_path, args.report, device=args.device))
    except ValidationError as error:  # the settings' own checks, one line for all of them
        print(f"error: invalid calibration settings: {settings_problems(error)}", file=sys.stderr)
        return 1
    except (CorruptCheckpointError, ValueError, OSError) as error:  # input errors: ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def adapter_text(calibration: AdapterCalibration) -> str:
    """The adapter's fit and quality, as printed by `calibrate`: the ridge chosen on the
    selection half, then served + adapter against served, both at T = 1, on the gate half and
    the test prompts, with the share of KL(T = 1) removed."""
    summary = calibration.summary
    tried = ", ".join(
        f"{'-' if ridge is None else f'{ridge:g}'}: {1e3 * kl:.3f}"
        for ridge, kl in calibration.selection_kl.items()
    )
    lines = [
        f"Adapter: rank {summary.rank} {summary.method}, {summary.layers} layers "
        f"({', '.join(summary.target_modules)}), {calibration.adapter.parameter_count} "
        f"parameters, ridge {summary.ridge} (selection-half KL at T=1 (1e-3) by ridge: {tried}); "
        + ("" if summary.distillation is None else f"{summary.distillation.describe()}; ")
        + f"{'recommended' if summary.recommended else 'NOT recommended'} (gate-half gain "
        "significant at 2 s.e.)",
        "",
        "| split | KL served T=1 (1e-3) | KL served+adapter T=1 | gain ± paired s.e. "
        "| share removed |",
        "|---|---:|---:|---:|---:|",
    ]
    for split, row in (("validation (gate half)", summary.validation), ("test", summary.test)):
        base = row.mean_kl + row.gain
        share = row.gain / base if base > 0 else float("nan")
        lines.append(
            f"| {split} | {1e3 * base:.3f} | {1e3 * row.mean_kl:.3f} | {1e3 * row.gain:+.3f} ± "
            f"{1e3 * row.gain_stderr:.3f} | {100 * share:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def _save_correction(folder: Path, bias: BiasCalibration) -> None:
    """Write the bias vector beside the profile."""
    from noisy_temp_server.correction.files import save_bias_file  # noqa: PLC0415

    save_bias_file(folder, bias.correction.bias)


def _temperatures(text: str) -> tuple[float, ...]:
    """`--request-temperatures`: comma-separated positive numbers (argparse reports a
    ValueError as a usage error); `CalibrationSettings` checks the rest."""
    return tuple(float(part) for part in text.split(",") if part.strip())
