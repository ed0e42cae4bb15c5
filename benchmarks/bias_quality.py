"""Held-out quality of the per-token logit bias + T beside the temperature rules, per family,
in-domain and cross-domain, on the embedded default model.

    .venv/bin/python benchmarks/bias_quality.py [--num-prompts 48] [--cross-prompts 24]
        [--max-new-tokens 32] [--families int4,wn0.02,...] [--w8a8 DIR] [--threads N]

Per perturbation family: the served model writes a completion for each of the first
`--num-prompts` shipped prompts (domain A) and each of `--cross-prompts` prompts of the
differently styled set `benchmarks/data/prompts_formal.jsonl` (domain B); the pair scorer keeps
records and full rows of every position. A's prompts are split as calibration splits them
(`CalibrationSettings`: half fit, a fifth validation, the rest test): the temperature rules are
fitted on the fit prompts and the bias as `calibrate_bias` fits it (penalty chosen on the
validation prompts, then refitted on fit + validation), both by `calibrate_records`; both are
measured on A's test prompts (in-domain) and on all of B (cross-domain), beside T = 1 and the
per-position oracle T. `--w8a8 DIR` adds a real compressed-tensors checkpoint from
`noisy-temp-server quantize --format w8a8 --out DIR`.
Writes benchmarks/results/bias_quality.md and bias_quality.json, a family at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch

from noisy_temp_server.estimation.bias_fit import (
    BiasQuality,
    bias_quality,
    score_with_rows,
)
from noisy_temp_server.estimation.calibration import calibrate_records, sample_completions
from noisy_temp_server.estimation.fitting import FITTED_RULES
from noisy_temp_server.estimation.profile import CalibrationSettings, QualityRow, QualityTable
from noisy_temp_server.estimation.prompts import load_prompts
from noisy_temp_server.estimation.quality import quality_table
from noisy_temp_server.pairs.default_model import ensure_default_model
from noisy_temp_server.pairs.loading import LoadedPair, load_pair
from noisy_temp_server.pairs.perturb import (
    PerturbationSpec,
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
)
from noisy_temp_server.pairs.scorer import PairScorer, ScoringSequence
from noisy_temp_server.settings import Settings

FAMILIES: dict[str, PerturbationSpec] = {
    "int4": QuantizationSpec(format="int4", group_size=128),
    "wn0.02": WeightNoiseSpec(scale=0.02),
    "runtime1": RuntimeLogitNoiseSpec(sigma=1.0),
    "int8": QuantizationSpec(format="int8"),
    "fp8": QuantizationSpec(format="fp8_e4m3"),
}
HERE = Path(__file__).resolve().parent
CROSS_PROMPTS = HERE / "data" / "prompts_formal.jsonl"
RESULTS = HERE / "results"


def _completions(pair: LoadedPair, prompts: list, args: argparse.Namespace, first_id: int):
    sequences = sample_completions(pair, prompts, max_new_tokens=args.max_new_tokens, seed=0)
    return [
        ScoringSequence(s.token_ids, s.prompt_length, first_id + s.sequence_id) for s in sequences
    ]


def _line(row: QualityRow, kl_one: float, name: str | None = None) -> str:
    share = 100 * row.gain / kl_one if kl_one > 0 else math.nan
    return (
        f"| {name or row.name} | {1e3 * row.mean_kl:.2f} | {1e3 * row.gain:+.2f} ± "
        f"{1e3 * row.gain_stderr:.2f} | {share:+.1f}% | {row.mean_temperature:.3f} |"
    )


def _table(title: str, rules: QualityTable, bias: BiasQuality) -> tuple[str, dict]:
    """Markdown lines of one test set: T = 1, the rules, the oracle (on every position) and the
    bias with T = 1 and the oracle on its rows (the same positions unless rows were capped)."""
    kl_one = rules.row("T=1").mean_kl
    lines = [
        f"**{title}**: {rules.positions} positions in {rules.sequences} prompts; same top token "
        f"{100 * rules.same_top_rate:.1f}% at any T, {100 * bias.same_top_rate:.1f}% with the "
        "bias",
        "",
        "| correction | KL (1e-3) | gain vs T=1 ± s.e. | share of KL(T=1) removed | mean T |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [_line(row, kl_one) for row in rules.rows]
    b = bias.row
    lines.append(_line(b, bias.t_one.mean_kl, "bias + T"))
    document = {
        "rules": rules.model_dump(mode="json"),
        "bias": b.model_dump(mode="json"),
        "bias_t_one_kl": bias.t_one.mean_kl,
        "bias_oracle_kl": bias.oracle.mean_kl,
        "bias_share_removed": bias.share_removed,
        "bias_same_top_rate": bias.same_top_rate,
        "same_top_rate": rules.same_top_rate,
    }
    return "\n".join(lines), document


def _family(name: str, pair: LoadedPair, args: argparse.Namespace) -> tuple[str, dict]:
    started = time.monotonic()
    domain_a = load_prompts()[: args.num_prompts]
    domain_b = load_prompts(CROSS_PROMPTS)[: args.cross_prompts]
    scorer = PairScorer(pair.clean_model, pair.served_model, runtime_noise=pair.runtime_noise)
    scored_a = score_with_rows(scorer, _completions(pair, domain_a, args, 0))
    scored_b = score_with_rows(scorer, _completions(pair, domain_b, args, len(domain_a)))
    settings = CalibrationSettings(
        prompts=len(domain_a),
        max_new_tokens=args.max_new_tokens,
        validation_fraction=0.2,
        test_fraction=0.3,
        request_temperatures=(1.0,),
    )
    fit_started = time.monotonic()
    identity = (pair.clean, pair.served)
    result = calibrate_records(scored_a.records, identity, None, settings, scored_a.rows)
    fit_seconds = time.monotonic() - fit_started
    calibration = result.bias
    assert calibration is not None  # rows were given
    policies = [result.profile.parameters.to_policy(rule) for rule in FITTED_RULES]
    cross_rules = quality_table(scored_b.records, policies, split="test")

    path, correction = calibration.path, calibration.correction
    in_text, in_doc = _table(
        "in-domain (test prompts of the shipped set)", result.profile.test_quality, calibration.test
    )
    cross_text, cross_doc = _table(
        "cross-domain (the formal prompt set)", cross_rules, bias_quality(scored_b.rows, correction)
    )
    seconds = time.monotonic() - started
    penalties = ", ".join(f"{p:.0e}: {1e3 * kl:.2f}" for p, kl in path.validation_kl.items())
    section = (
        f"## {name} ({pair.served.describe()})\n\nwall time {seconds:.0f} s (fits "
        f"{fit_seconds:.0f} s); recommended temperature rule: "
        f"{result.profile.recommended_rule.value}; bias recommended: {calibration.recommended}, "
        f"penalty {path.chosen.penalty:.0e}, "
        f"T {correction.temperature:.3f}, max |b| {float(correction.bias.abs().max()):.2f}; "
        f"validation KL (1e-3) by penalty (inf: T only): {penalties}\n\n"
        f"{in_text}\n\n{cross_text}\n"
    )
    document = {
        "family": name,
        "served": pair.served.describe(),
        "seconds": seconds,
        "bias_fit_seconds": fit_seconds,
        "recommended_rule": result.profile.recommended_rule.value,
        "bias_recommended": calibration.recommended,
        "penalty": path.chosen.penalty,
        "bias_temperature": correction.temperature,
        "validation_kl_by_penalty": {str(p): kl for p, kl in path.validation_kl.items()},
        "in_domain": in_doc,
        "cross_domain": cross_doc,
    }
    return section, document


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--cross-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--w8a8", type=Path, default=None, help="a `quantize --format w8a8` dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    clean_path = ensure_default_model(Settings().cache_dir)
    pairs: list[tuple[str, dict]] = [
        (name, {"spec": FAMILIES[name]}) for name in args.families.split(",") if name
    ]
    if args.w8a8 is not None:
        pairs.append(("w8a8", {"served_path": args.w8a8}))
    header = (
        f"# Per-token bias + T beside the temperature rules on {clean_path.name}\n\n"
        f"{args.num_prompts} shipped prompts (fit / validation / test by prompt), "
        f"{args.cross_prompts} formal prompts (cross-domain test), completions of up to "
        f"{args.max_new_tokens} tokens sampled from the served model; {torch.get_num_threads()} "
        "torch threads. KL in 1e-3 nats; gain = KL(T=1) - KL paired by position with its "
        "prompt-clustered standard error.\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    sections, documents = [], []
    started = time.monotonic()
    for name, how in pairs:
        pair = load_pair(clean_path, device=args.device, **how)
        section, document = _family(name, pair, args)
        print(section, flush=True)
        sections.append(section)
        documents.append(document)
        (args.out / "bias_quality.md").write_text(header + "\n" + "\n".join(sections))
        (args.out / "bias_quality.json").write_text(
            json.dumps({"seconds": time.monotonic() - started, "results": documents}, indent=2)
        )
    print(f"total wall time {time.monotonic() - started:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
