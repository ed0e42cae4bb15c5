"""Test-split quality of every temperature rule on the embedded default model, per perturbation
family and request temperature.

    .venv/bin/python benchmarks/quality.py [--families int4 logit-noise ...] [--num-prompts 48]
        [--max-new-tokens 32] [--served NAME=DIR ...] [--threads N] [--profiles DIR]
        [--records DIR]

Families: noise-0.01, noise-0.02, noise-0.05 (gaussian weight noise), int4 (RTN, group 128),
int8, fp8 (e4m3) and logit-noise (runtime logit noise sigma = 1); default: all of these, or
none when `--served` is given. int4-g64 (RTN, group 64: the group of the real quantizers'
checkpoints of `scripts/quantize_embedded.py`) runs only when named. For each, runs
the calibration pipeline (served-model completions, pair scoring at the request temperatures
0.5, 0.7, 1.0 and 1.2, rules fitted on the fit prompts, the recommended rule chosen on the
validation prompts) and reports on the test prompts, per request temperature T_r (KL to the
clean model at T_r, softmax(z/T_r)):

- mean KL at T* = 1 and of the per-position oracle; the closure of the T = 1 -> oracle gap of
  every rule (`fixed` is one constant fitted at T_r = 1; `calibrated` has one band per T_r);
- `const`: the best constant fitted on the fit prompts at this T_r (the calibrated band's
  starting point), and `hindsight`: the best constant fitted on the test prompts themselves,
  an upper bound for any constant; with their T;
- the served (recommended) rule's closure next to the hindsight constant's;
- "never behind the constant": the paired per-position difference KL(const) - KL(calibrated)
  on the test prompts, its mean ± cluster-robust standard error; the check passes when
  mean + 2 s.e. >= 0;
- "never worse than T = 1": the same for KL(T = 1) - KL(calibrated).

Per family, the per-token logit bias + T (`calibration.bias_fit`, fitted by the same
calibration on the T_r = 1 rows of the fit prompts, its penalty chosen on the validation
prompts) on the test prompts: the share of KL(T = 1) it removes ± s.e., beside T = 1, every
rule and the per-position oracle T at T_r = 1 (`bias_section`, which
`experiments/bias_quality.py` also prints, with a cross-domain test set and more fit data);
then at every request temperature, as it is served (with the T of its band there), beside
the recommended rule and the oracle on the same test rows, and its paired gain over the rule.
`--served NAME=DIR` (repeatable) adds an external served checkpoint: any model folder
`load_pair(clean, served_path=DIR)` takes (a compressed-tensors checkpoint from llm-compressor,
`scripts/quantize_embedded.py` or `noisy-temp-server quantize --format w8a8 --out DIR`, a plain
float folder), measured after the families under NAME. `--w8a8 DIR` is short for
`--served w8a8=DIR`.

`--adapter-rank R` calibrates every family with the compensation adapter first
(`calibrate --adapter-rank R`: every table above then measures the rules and the bias on top
of it where it is recommended) and adds each layer of the stack on the test prompts (and on
`--cross-domain FILE`'s prompts): served T = 1, adapter alone, adapter + T, adapter + bias +
T, beside the per-position oracle T, with greedy agreement (`benchmarks/quality_adapter.py`);
runtime logit noise is refused an adapter by calibration and reported so. Results then go to
quality_adapter.md and quality_adapter.json.

Writes benchmarks/results/quality.md and quality.json (after each family). 48 prompts (about
19 fit, 14 validation, 15 test) of 32 tokens take a few minutes per family with --threads 1 on
2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from quality_adapter import calibrate_family, stack_section

from noisy_temp_server.calibration.bias_fit import (
    penalties_text,
    rule_temperatures_by_request_temperature,
)
from noisy_temp_server.calibration.bias_quality import BiasQuality, ScoredSet, bias_quality
from noisy_temp_server.calibration.curves import best_curve_temperature
from noisy_temp_server.calibration.fitting import FITTED_RULES, finite_positions, rule_temperatures
from noisy_temp_server.calibration.pipeline import (
    CalibrationResult,
    calibrate_scored,
    score_pair,
)
from noisy_temp_server.calibration.profile import QualityRow, QualityTable
from noisy_temp_server.calibration.prompts import Prompt, load_prompts
from noisy_temp_server.calibration.quality import quality_row
from noisy_temp_server.calibration.settings import CalibrationSettings, settings_problems
from noisy_temp_server.calibration.significance import is_not_worse
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.checkpoints.perturbation import (
    PerturbationSpec,
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
)
from noisy_temp_server.correction.request_bands import BandedBias, at_request_temperature
from noisy_temp_server.scoring.records import PositionRecords, interpolate_kl
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.rules import Rule

FAMILIES: dict[str, PerturbationSpec] = {
    "noise-0.01": WeightNoiseSpec(scale=0.01),
    "noise-0.02": WeightNoiseSpec(scale=0.02),
    "noise-0.05": WeightNoiseSpec(scale=0.05),
    "int4": QuantizationSpec(format="int4", group_size=128),
    "int4-g64": QuantizationSpec(format="int4", group_size=64),
    "int8": QuantizationSpec(format="int8"),
    "fp8": QuantizationSpec(format="fp8_e4m3"),
    "logit-noise": RuntimeLogitNoiseSpec(sigma=1.0),
}
# what a run without --families (and without --served) measures: int4-g64 only when named
DEFAULT_FAMILIES = [name for name in FAMILIES if name != "int4-g64"]
RESULTS = Path(__file__).resolve().parent / "results"


def served_argument(text: str) -> tuple[str, Path]:
    """`--served NAME=DIR` as (NAME, DIR)."""
    name, equals, folder = text.partition("=")
    if not equals or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    if name in FAMILIES:
        raise argparse.ArgumentTypeError(f"{name!r} is a perturbation family's name")
    return name, Path(folder).expanduser()


def served_options(parser: argparse.ArgumentParser) -> None:
    """`--served NAME=DIR` (repeatable) and its short form `--w8a8 DIR`."""
    parser.add_argument(
        "--served",
        type=served_argument,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also measure this served model folder (e.g. a compressed-tensors checkpoint) "
        "under NAME; repeatable",
    )
    parser.add_argument(
        "--w8a8",
        type=Path,
        default=None,
        help="short for --served w8a8=DIR (`quantize --format w8a8`)",
    )


def served_checkpoints(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """The (name, folder) of every `--served` and `--w8a8` checkpoint, names unique."""
    served = list(args.served) + ([] if args.w8a8 is None else [("w8a8", args.w8a8)])
    names = [name for name, _ in served]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: --served names must be unique, got {names}")
    return served


def served_pairs(
    families: list[str], served: list[tuple[str, Path]]
) -> list[tuple[str, dict[str, Any]]]:
    """(name, `load_pair` keyword arguments) of each family, then of each external served
    checkpoint folder (`--served NAME=DIR`)."""
    pairs: list[tuple[str, dict[str, Any]]] = [(f, {"spec": FAMILIES[f]}) for f in families]
    pairs.extend((name, {"served_path": folder}) for name, folder in served)
    return pairs


def _at(records: PositionRecords, request_temperature: float) -> PositionRecords:
    return finite_positions(records.select(records.request_temperature == request_temperature))


def _kl_at_constant(records: PositionRecords, temperature: float) -> torch.Tensor:
    constant = torch.full((len(records),), temperature)
    return interpolate_kl(records.kl_curve, records.curve_temperatures, constant)


def _request_temperature_row(
    result: CalibrationResult, request_temperature: float, bounds: Any
) -> dict[str, Any]:
    """Every figure of one (family, T_r) line, from the test records at T_r."""
    fit, test = _at(result.fit, request_temperature), _at(result.test, request_temperature)
    profile = result.profile
    kl_one = float(test.kl_at_one.double().mean())
    kl_oracle = float(test.oracle_kl.double().mean())
    gap = kl_one - kl_oracle

    def closure(kl: torch.Tensor) -> float:
        return (kl_one - float(kl.double().mean())) / gap

    rule_kl = {
        rule.value: interpolate_kl(
            test.kl_curve,
            test.curve_temperatures,
            rule_temperatures(profile.to_policy(rule), test),
        )
        for rule in FITTED_RULES
    }
    rule_kl["off"] = test.kl_at_one
    constant_t = best_curve_temperature(fit.kl_curve, fit.curve_temperatures, bounds)
    hindsight_t = best_curve_temperature(test.kl_curve, test.curve_temperatures, bounds)
    constant_kl = _kl_at_constant(test, constant_t)
    versus = quality_row(
        "calibrated",
        kl=rule_kl["calibrated"],
        temperatures=rule_temperatures(profile.to_policy(Rule.CALIBRATED), test),
        sequence_ids=test.sequence_id,
        kl_at_one=test.kl_at_one,
        kl_one=kl_one,
        kl_oracle=kl_oracle,
        kl_fixed=constant_kl,
    )
    assert versus.gain_over_fixed is not None
    assert versus.gain_over_fixed_stderr is not None
    over_one = (test.kl_at_one - rule_kl["calibrated"]).double()
    over_one_mean, over_one_stderr = (
        float(over_one.mean()),
        cluster_stderr(over_one, test.sequence_id),
    )
    served = profile.recommended_rule.value
    return {
        "request_temperature": request_temperature,
        "positions": len(test),
        "kl_t1": kl_one,
        "kl_oracle": kl_oracle,
        "closure": {name: closure(kl) for name, kl in rule_kl.items() if name != "off"},
        "constant_t": constant_t,
        "constant_closure": closure(constant_kl),
        "hindsight_t": hindsight_t,
        "hindsight_closure": closure(_kl_at_constant(test, hindsight_t)),
        "served_rule": served,
        "served_closure": closure(rule_kl[served]),
        "calibrated_minus_constant": versus.gain_over_fixed,
        "calibrated_minus_constant_stderr": versus.gain_over_fixed_stderr,
        "not_behind_constant": is_not_worse(versus.gain_over_fixed, versus.gain_over_fixed_stderr),
        "calibrated_minus_t1": over_one_mean,
        "calibrated_minus_t1_stderr": over_one_stderr,
        "not_worse_than_t1": is_not_worse(over_one_mean, over_one_stderr),
    }


def _bias_line(row: QualityRow, kl_one: float, name: str | None = None) -> str:
    share = 100 * row.gain / kl_one if kl_one > 0 else math.nan
    return (
        f"| {name or row.name} | {1e3 * row.mean_kl:.2f} | {1e3 * row.gain:+.2f} ± "
        f"{1e3 * row.gain_stderr:.2f} | {share:+.1f}% | {row.mean_temperature:.3f} |"
    )


def bias_section(title: str, rules: QualityTable, bias: BiasQuality) -> tuple[str, dict]:
    """Markdown lines and JSON of one test set: T = 1, the rules, the oracle (on every position)
    and the bias with T = 1 and the oracle on its rows (the same positions unless rows were
    capped), each as the share of KL(T = 1) it removes ± its prompt-clustered s.e."""
    kl_one = rules.row("T=1").mean_kl
    lines = [
        f"**{title}**: {rules.positions} positions in {rules.sequences} prompts "
        f"({bias.positions} with rows for the bias); same top token "
        f"{100 * rules.same_top_rate:.1f}% at any T; on the bias rows "
        f"{100 * bias.same_top_rate_t_one:.1f}% at T = 1, {100 * bias.same_top_rate:.1f}% with "
        "the bias",
        "",
        "| correction | KL (1e-3) | gain vs T=1 ± s.e. | share of KL(T=1) removed | mean T |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [_bias_line(row, kl_one) for row in rules.rows]
    lines.append(_bias_line(bias.t_one, bias.t_one.mean_kl, "T=1 (bias rows)"))
    lines.append(_bias_line(bias.oracle, bias.t_one.mean_kl, "oracle (bias rows)"))
    lines.append(_bias_line(bias.row, bias.t_one.mean_kl, "bias + T"))
    document = {
        "rules": rules.model_dump(mode="json"),
        "bias": bias.row.model_dump(mode="json"),
        "bias_t_one_kl": bias.t_one.mean_kl,
        "bias_oracle_kl": bias.oracle.mean_kl,
        "bias_share_removed": bias.share_removed,
        "bias_same_top_rate": bias.same_top_rate,
        "same_top_rate": rules.same_top_rate,
    }
    return "\n".join(lines), document


def _bias_at_one(result: CalibrationResult, settings: CalibrationSettings) -> tuple[str, dict]:
    """The bias's section on the test prompts at T_r = 1 (where it is fitted and served)."""
    calibration = result.bias
    assert calibration is not None  # calibrate keeps rows
    at_one = settings.request_temperatures.index(1.0)
    rules = result.profile.test_quality_by_request_temperature[at_one]
    text, document = bias_section(
        "per-token bias + T, test prompts, T_r = 1", rules, calibration.test
    )
    penalty, head_penalty = calibration.path.chosen.penalty, calibration.path.chosen.head_penalty
    head = (
        f"bias: {'recommended' if calibration.recommended else 'not recommended'} (gate half: "
        "gain over T=1 > 2 s.e. and not behind the recommended rule, "
        f"{'met' if calibration.recommended else 'not met'}), "
        f"{penalties_text(calibration.path.chosen)}, "
        f"T {calibration.correction.temperature:.3f}"
    )
    return f"{head}\n\n{text}\n", {
        **document,
        "recommended": calibration.recommended,
        "penalty": penalty if math.isfinite(penalty) else None,
        "head_penalty": head_penalty if math.isfinite(head_penalty) else None,
        "temperature": calibration.correction.temperature,
    }


def _bias_by_request_temperature(
    result: CalibrationResult, scored: ScoredSet, settings: CalibrationSettings
) -> tuple[str, list[dict]]:
    """The bias as served (with its band's T) at every request temperature on the test rows,
    beside T = 1, the recommended rule and the oracle there, as shares of KL(T = 1) removed,
    and its paired gain over the rule ± s.e. (rows taken to T_r: `at_request_temperature`)."""
    calibration = result.bias
    assert calibration is not None  # calibrate keeps rows
    test = torch.isin(scored.rows.sequence_id, torch.unique(result.test.sequence_id))
    rows, records = scored.rows.select(test), scored.row_records.select(test)
    rule = result.profile.to_policy(result.profile.recommended_rule)
    lines = [
        f"bias as served at each T_r (test rows; the rule: `{rule.rule.value}`)",
        "",
        "| T_r | KL T=1 (1e-3) | rule | bias + band T | oracle | bias − rule ± s.e. (1e-3) "
        "| band T |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    documents = []
    rule_by_t_r = rule_temperatures_by_request_temperature(
        rule, records, settings.request_temperatures
    )
    served = BandedBias(calibration.correction, calibration.band_temperatures)
    for t_r, band in served.band_temperatures.items():
        quality = bias_quality(
            at_request_temperature(rows, t_r),
            served.at(t_r),
            settings.min_quality_positions,
            rule_temperatures={1.0: rule_by_t_r[t_r]},  # the rows are at T_r already
        )
        assert quality.over_rule is not None
        gain, stderr = quality.over_rule
        kl_one = quality.t_one.mean_kl
        kl_rule = quality.row.mean_kl + gain

        def share(kl: float, kl_one: float = kl_one) -> float:
            return (kl_one - kl) / kl_one if kl_one > 0 else math.nan

        document = {
            "request_temperature": t_r,
            "band_temperature": band,
            "kl_t1": kl_one,
            "rule_share_removed": share(kl_rule),
            "bias_share_removed": quality.share_removed,
            "oracle_share_removed": share(quality.oracle.mean_kl),
            "bias_minus_rule": gain,
            "bias_minus_rule_stderr": stderr,
        }
        documents.append(document)
        lines.append(
            f"| {t_r:g} | {1e3 * kl_one:.2f} | {_percent(document['rule_share_removed'])} "
            f"| {_percent(quality.share_removed)} | {_percent(document['oracle_share_removed'])} "
            f"| {1e3 * gain:+.3f} ± {1e3 * stderr:.3f} | {band:.3f} |"
        )
    return "\n".join(lines) + "\n", documents


def _percent(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _markdown(label: str, seconds: float, result: CalibrationResult, rows: list[dict]) -> str:
    rules = [rule.value for rule in FITTED_RULES]
    lines = [
        f"## {label}",
        "",
        f"served (recommended on validation): {result.profile.recommended_rule.value}; "
        f"wall time {seconds:.0f} s; test split: "
        f"{result.profile.test_quality.sequences} prompts",
        "",
        "| T_r | KL T=1 | "
        + " | ".join(rules)
        + " | const (T) | hindsight (T) | oracle KL | served | calibrated − const ± s.e. "
        "| calibrated − T=1 ± s.e. |",
        "|---:|---:|" + "---:|" * len(rules) + "---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        closures = " | ".join(_percent(row["closure"][rule]) for rule in rules)
        check = "ok" if row["not_behind_constant"] else "BEHIND"
        versus_one = "ok" if row["not_worse_than_t1"] else "WORSE"
        lines.append(
            f"| {row['request_temperature']:g} | {1e3 * row['kl_t1']:.2f} | {closures} "
            f"| {_percent(row['constant_closure'])} ({row['constant_t']:.3f}) "
            f"| {_percent(row['hindsight_closure'])} ({row['hindsight_t']:.3f}) "
            f"| {1e3 * row['kl_oracle']:.2f} "
            f"| {_percent(row['served_closure'])} vs {_percent(row['hindsight_closure'])} "
            f"| {1e3 * row['calibrated_minus_constant']:+.3f} ± "
            f"{1e3 * row['calibrated_minus_constant_stderr']:.3f} {check} "
            f"| {1e3 * row['calibrated_minus_t1']:+.3f} ± "
            f"{1e3 * row['calibrated_minus_t1_stderr']:.3f} {versus_one} |"
        )
    return "\n".join(lines) + "\n"


def _calibrate(
    pair: LoadedPair,
    prompts: list[Prompt],
    settings: CalibrationSettings,
    args: argparse.Namespace,
) -> tuple[CalibrationResult, ScoredSet, str, dict[str, Any]]:
    """The family's calibration and scores; with `--adapter-rank`, calibrated with the adapter
    and the stack's markdown and JSON (`quality_adapter`), else empty ones."""
    if not settings.adapter_rank:
        scored = score_pair(pair, prompts, settings, device=args.device)
        return calibrate_scored(pair, scored, settings), scored, "", {}
    family = calibrate_family(pair, prompts, settings, device=args.device)
    text, document = stack_section(
        pair,
        family,
        [] if args.cross_domain is None else load_prompts(args.cross_domain),
        greedy_tokens=args.greedy_tokens,
        device=args.device,
    )
    return family.data.result, family.data.scored, "\n" + text, {"adapter_stack": document}


def _adapter_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adapter-rank",
        type=int,
        default=0,
        help="calibrate with a compensation adapter of this rank and measure its stack (0: off)",
    )
    parser.add_argument(
        "--adapter-method", choices=("propagated", "eora", "svd"), default="propagated"
    )
    parser.add_argument(
        "--adapter-fit-completions",
        type=int,
        default=1,
        help="with --adapter-rank: refit the adapter on this many completions of each fit and "
        "selection prompt",
    )
    parser.add_argument(
        "--adapter-distil-epochs",
        type=int,
        default=0,
        help="with --adapter-rank: distil the adapter for up to this many epochs (0: off)",
    )
    parser.add_argument(
        "--cross-domain",
        type=Path,
        default=None,
        help="with --adapter-rank: also measure the stack on these prompts (JSONL)",
    )
    parser.add_argument(
        "--greedy-tokens", type=int, default=16, help="greedy answer length for the stack"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families",
        nargs="+",
        choices=list(FAMILIES),
        default=None,
        help="perturbation families to run (default: all but int4-g64; none with --served)",
    )
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    served_options(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--profiles",
        type=Path,
        default=None,
        help="also write each family's profile here, as <family>.profile.json",
    )
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        help="also save each family's fit/validation/test records here, as "
        "<family>.<split>.safetensors (what experiments/context_features.py reads)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is much faster on a loaded, shared machine",
    )
    _adapter_arguments(parser)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()
    prompts = load_prompts()[: args.num_prompts]
    try:
        settings = CalibrationSettings(
            prompts=len(prompts),
            max_new_tokens=args.max_new_tokens,
            adapter_rank=args.adapter_rank,
            adapter_method=args.adapter_method,
            adapter_fit_completions=args.adapter_fit_completions,
            adapter_distil_epochs=args.adapter_distil_epochs,
        )
    except ValidationError as error:
        print(f"error: invalid calibration settings: {settings_problems(error)}", file=sys.stderr)
        return 1
    clean_path = ensure_default_model(Settings().cache_dir)
    served = served_checkpoints(args)
    if args.families is None:
        args.families = [] if served else DEFAULT_FAMILIES
    pairs = served_pairs(args.families, served)
    sections, documents = [], []
    for name, how in pairs:
        family_started = time.monotonic()
        pair = load_pair(clean_path, device=args.device, **how)
        result, scored, adapter_text, adapter_document = _calibrate(pair, prompts, settings, args)
        rows = [
            _request_temperature_row(result, t, settings.bounds)
            for t in settings.request_temperatures
        ]
        bias_text, bias_document = _bias_at_one(result, settings)
        served_text, served_bias = _bias_by_request_temperature(result, scored, settings)
        seconds = time.monotonic() - family_started
        if args.profiles is not None:
            args.profiles.mkdir(parents=True, exist_ok=True)
            result.profile.save(args.profiles / f"{name}.profile.json")
        if args.records is not None:
            args.records.mkdir(parents=True, exist_ok=True)
            for split in ("fit", "validation", "test"):
                getattr(result, split).save(args.records / f"{name}.{split}.safetensors")
        label = how["spec"].label if "spec" in how else f"{name}: {pair.served.describe()}"
        section = _markdown(label, seconds, result, rows) + "\n" + bias_text + "\n" + served_text
        section += adapter_text
        print(section, flush=True)
        sections.append(section)
        documents.append(
            {
                "family": name,
                "perturbation": None if "spec" not in how else how["spec"].model_dump(mode="json"),
                "served": pair.served.describe(),
                "served_path": None if "spec" in how else str(how["served_path"]),
                "seconds": seconds,
                "recommended_rule": result.profile.recommended_rule.value,
                "by_request_temperature": rows,
                "parameters": result.profile.parameters.model_dump(mode="json"),
                "validation_quality": result.profile.validation_quality.model_dump(mode="json"),
                "test_quality": result.profile.test_quality.model_dump(mode="json"),
                "bias": {**bias_document, "by_request_temperature": served_bias},
                **adapter_document,
            }
        )
        total = time.monotonic() - started
        _write(args, settings, clean_path.name, total=total, sections=sections, documents=documents)
    print(f"total wall time {time.monotonic() - started:.0f} s; results in {args.out}")
    return 0


def _write(
    args: argparse.Namespace,
    settings: CalibrationSettings,
    model: str,
    *,
    total: float,
    sections: list[str],
    documents: list[dict],
) -> None:
    """Write quality.md and quality.json of the families done so far (quality_adapter.* with
    `--adapter-rank`)."""
    header = (
        f"# Test-split quality on {model}\n\n{settings.prompts} prompts split fit / "
        f"validation / test ({settings.validation_fraction:g} validation, "
        f"{settings.test_fraction:g} test), completions of up to {args.max_new_tokens} tokens "
        f"sampled from the served model, device {args.device}, {torch.get_num_threads()} torch "
        f"threads; total wall time {total:.0f} s. Closure = (KL(T=1) - KL) / (KL(T=1) - "
        "KL(oracle)) on the test prompts at each request temperature T_r; KL in 1e-3 nats. "
        "const: the best constant fitted on the fit prompts at T_r; hindsight: the best "
        "constant fitted on the test prompts. calibrated − const: paired per-position "
        "KL(const) - KL(calibrated) ± cluster-robust s.e.; ok when mean + 2 s.e. >= 0 (and "
        "the same for calibrated − T=1). The bias table: gain = KL(T=1) - KL paired by position "
        "with its prompt-clustered s.e.\n"
    )
    stem = "quality"
    if args.adapter_rank:
        stem = "quality_adapter"
        header += (
            f"\nCalibrated with the compensation adapter (rank {args.adapter_rank}, "
            f"{args.adapter_method}): where it is recommended, every table measures the rules "
            "and the bias on top of it (their T = 1 is the adapter's); the stack tables measure "
            "each layer against the served model at T = 1 on the same positions, the greedy "
            f"columns over answers of {args.greedy_tokens} tokens.\n"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(header + "\n" + "\n".join(sections), encoding="utf-8")
    (args.out / f"{stem}.json").write_text(
        json.dumps({"total_seconds": total, "results": documents}, indent=2) + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    raise SystemExit(main())
