"""Held-out quality of the per-token logit bias + T beside the temperature rules, per family,
in-domain and cross-domain, on the embedded default model.

    .venv/bin/python experiments/bias_quality.py [--num-prompts 80] [--samples 1]
        [--cross-prompts 24] [--max-new-tokens 64] [--max-rows 4096]
        [--families int4,noise-0.02,...] [--served NAME=DIR ...] [--stream-samples K]
        [--request-temperatures 0.5 1.0] [--threads N]

Per perturbation family: the served model writes `--samples` completions (seeds 0, 1, ...) for
each of the first `--num-prompts` shipped prompts (domain A; default all 80) and one for each of
`--cross-prompts` prompts of the differently styled set `benchmarks/data/prompts_formal.jsonl`
(domain B); the pair scorer keeps records of every position and full rows of at most
`--max-rows` evenly spaced positions per domain. A prompt's completions share its id, so
splits and standard errors are by prompt. Two fits, two test sets:

- in-domain: A's prompts are split as calibration splits them (`CalibrationSettings`: half fit,
  a fifth validation, the rest test); the temperature rules are fitted on the fit prompts and
  the bias as `calibrate_bias` fits it (penalty chosen on the validation prompts, then refitted
  on fit + validation), both by `calibrate_records`, and measured on A's test prompts, which
  neither saw;
- cross-domain: the bias is fitted on all of A (`fit_bias_for_serving`: a fifth of A's prompts
  choose the penalty, then the refit on all of A), the rules are those of the in-domain fit,
  and both are measured on all of B.

Each beside T = 1 and the per-position oracle T on the same positions. With `--stream-samples
K`, the in-domain correction is then refined online as `serve` refines it on traffic like its
own: K more rounds of completions (later seeds) of every non-test shipped prompt, each
completion a request of at most `Settings().shadow_bias_rows` evenly spaced rows to
`OnlineBias.refining`, as the online estimator builds it (the calibrated penalties, the clean
head, the rows the calibrated bias was fitted on as prior rows; every 4th request held out),
its streaming fit measured on the in-domain test prompts after every round, at every request
temperature of `--request-temperatures` (default 1.0; the bias then has a band's T at each,
refined online too; the rows taken to T_r exactly). `--served NAME=DIR` (repeatable) adds a
served model folder, e.g. a compressed-tensors checkpoint from `scripts/quantize_embedded.py` or
`noisy-temp-server quantize --format w8a8 --out DIR` (`--w8a8 DIR`: `--served w8a8=DIR`).
Writes experiments/results/bias_quality.md and bias_quality.json, a family at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # quality.py

from quality import FAMILIES, bias_section, served_checkpoints, served_options, served_pairs

from noisy_temp_server.calibration.bias_fit import (
    BiasCalibration,
    fit_bias_for_serving,
    penalties_text,
)
from noisy_temp_server.calibration.bias_quality import ScoredSet, bias_quality, score_with_rows
from noisy_temp_server.calibration.completions import sample_completions
from noisy_temp_server.calibration.fitting import FITTED_RULES
from noisy_temp_server.calibration.pipeline import calibrate_records
from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.calibration.quality import quality_table
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    split_by_sequence,
    split_fit_validation_test,
)
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.correction.paired_rows import PairedRows
from noisy_temp_server.correction.request_bands import BandedBias, at_request_temperature
from noisy_temp_server.online.bias import OnlineBias
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.settings import Settings

HERE = Path(__file__).resolve().parent
CROSS_PROMPTS = HERE.parent / "benchmarks" / "data" / "prompts_formal.jsonl"
RESULTS = HERE / "results"


def scored_completions(
    scorer: PairScorer,
    pair: LoadedPair,
    prompts: list,
    *,
    max_new_tokens: int,
    max_rows: int | None,
    samples: int,
    first_id: int,
    request_temperatures: tuple[float, ...] = (1.0,),
) -> ScoredSet:
    """Records (at each of `request_temperatures`) and rows (at most `max_rows`, None: all) of
    `samples` completions (seeds 0, 1, ...) per prompt; the completions of prompt i share the
    sequence id `first_id + i`."""
    sequences = [
        ScoringSequence(s.token_ids, s.prompt_length, first_id + s.sequence_id)
        for seed in range(samples)
        for s in sample_completions(pair, prompts, max_new_tokens=max_new_tokens, seed=seed)
    ]
    return score_with_rows(
        scorer, sequences, request_temperatures=request_temperatures, max_rows=max_rows
    )


def _by_penalty(scores: dict[float, float]) -> str:
    return ", ".join(f"{p:.0e}: {1e3 * kl:.2f}" for p, kl in scores.items()) or "none"


def _requests(rows: PairedRows, per_request: int) -> list[PairedRows]:
    """The rows of each sequence in order, at most `per_request` evenly spaced ones each (what
    the shadow scorer passes on for one request)."""
    requests = []
    for sequence in torch.unique_consecutive(rows.sequence_id).tolist():
        where = torch.nonzero(rows.sequence_id == sequence).flatten()
        keep = torch.linspace(0, len(where) - 1, min(per_request, len(where))).round().long()
        requests.append(rows.select(where[torch.unique(keep)]))
    return requests


def _streamed(
    scorer: PairScorer,
    pair: LoadedPair,
    scored_a: ScoredSet,
    *,
    calibration: BiasCalibration,
    settings: CalibrationSettings,
    basis: torch.Tensor | None,
    args: argparse.Namespace,
) -> tuple[str, list[dict]]:
    """`--stream-samples` rounds of online refinement (module docstring): markdown lines and
    one JSON object per round."""
    fractions = (settings.validation_fraction, settings.test_fraction, settings.seed)
    *_, test = split_fit_validation_test(scored_a.rows.sequence_id, *fractions)
    test_rows = scored_a.rows.select(test)
    test_ids = set(test_rows.sequence_id.unique().tolist())
    shipped = load_prompts()[: args.num_prompts]
    prompts = [(i, p) for i, p in enumerate(shipped) if i not in test_ids]
    if calibration.path.refine_penalty is None:
        return "online refinement: none (the T-only fit won on validation, no bias to refine)", []
    online = OnlineBias.refining(
        calibration.correction,
        calibration.summary(),
        request_temperatures=settings.request_temperatures,
        head_basis=basis,
        bounds=settings.bounds,
    )
    in_span = online.fit.steps_in_head_span
    per_request = Settings().shadow_bias_rows
    lines = [
        f"**online refinement on in-domain traffic** ({len(prompts)} non-test shipped prompts "
        f"per round, at most {per_request} rows per request, every 4th request held out; "
        f"the calibrated fit's {online.fit.prior_rows} rows counted as seen; "
        f"steps in the head's span: {in_span}), measured on the {len(test_ids)} in-domain test "
        "prompts:",
        "",
        "| after round | rows fitted | T_r | band T | bias + T: share of KL(T=1) removed ± s.e. "
        "| oracle T | held-out gate would publish |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    calibrated = BandedBias(calibration.correction, calibration.band_temperatures)
    start = _round_figures(test_rows, calibrated, rows_fitted=0)
    lines.append(_round_line("0 (calibrated)", start, "(served)"))
    documents = []
    for round_index in range(args.stream_samples):
        seed = args.samples + round_index
        completions = sample_completions(
            pair, [p for _, p in prompts], max_new_tokens=args.max_new_tokens, seed=seed
        )
        sequences = [
            ScoringSequence(s.token_ids, s.prompt_length, prompts[s.sequence_id][0])
            for s in completions
        ]
        scored = score_with_rows(scorer, sequences, max_rows=per_request * len(sequences))
        for request in _requests(scored.rows, per_request):
            online.add(request)
        figures = _round_figures(test_rows, online.fit.banded, online.fit.rows_seen)
        figures |= {"round": round_index + 1, "would_publish": online.candidate() is not None}
        lines.append(_round_line(str(round_index + 1), figures, str(figures["would_publish"])))
        print(lines[-1], flush=True)
        documents.append(figures)
    return "\n".join(lines), documents


def _round_figures(test_rows: PairedRows, correction: BandedBias, rows_fitted: int) -> dict:
    """`correction` on the test rows at each of its request temperatures (the rows taken
    there, its band's T): shares of KL(T = 1) removed by it (± s.e.) and by the per-position
    oracle T."""
    by_request_temperature = []
    for t_r, band in correction.band_temperatures.items():
        quality = bias_quality(at_request_temperature(test_rows, t_r), correction.at(t_r))
        kl_one = quality.t_one.mean_kl
        by_request_temperature.append(
            {
                "request_temperature": t_r,
                "band_temperature": band,
                "share_removed": quality.share_removed,
                "share_stderr": quality.row.gain_stderr / kl_one,
                "oracle_share": 1 - quality.oracle.mean_kl / kl_one,
            }
        )
    return {"rows_fitted": rows_fitted, "by_request_temperature": by_request_temperature}


def _round_line(label: str, figures: dict, publish: str) -> str:
    return "\n".join(
        f"| {label} | {figures['rows_fitted']} | {band['request_temperature']:g} "
        f"| {band['band_temperature']:.3f} | {100 * band['share_removed']:+.1f}% ± "
        f"{100 * band['share_stderr']:.1f} | {100 * band['oracle_share']:+.1f}% | {publish} |"
        for band in figures["by_request_temperature"]
    )


def _family(name: str, pair: LoadedPair, args: argparse.Namespace) -> tuple[str, dict]:
    started = time.monotonic()
    domain_a = load_prompts()[: args.num_prompts]
    domain_b = load_prompts(CROSS_PROMPTS)[: args.cross_prompts]
    scorer = PairScorer(pair.clean_model, pair.served_model, runtime_noise=pair.runtime_noise)
    request_temperatures = tuple(sorted({1.0, *args.request_temperatures}))
    scored_a = scored_completions(
        scorer,
        pair,
        domain_a,
        max_new_tokens=args.max_new_tokens,
        max_rows=args.max_rows,
        samples=args.samples,
        first_id=0,
        request_temperatures=request_temperatures,
    )
    scored_b = scored_completions(
        scorer,
        pair,
        domain_b,
        max_new_tokens=args.max_new_tokens,
        max_rows=args.max_rows,
        samples=1,
        first_id=len(domain_a),
    )
    settings = CalibrationSettings(
        prompts=len(domain_a),
        max_new_tokens=args.max_new_tokens,
        validation_fraction=0.2,
        test_fraction=0.3,
        request_temperatures=request_temperatures,
        bias_rows=args.max_rows,
    )
    fit_started = time.monotonic()
    identity = (pair.clean, pair.served)
    basis = None if args.per_token_only else pair.head_basis(scored_a.rows.vocab_size)
    result = calibrate_records(
        scored_a.records,
        identity,
        None,
        settings,
        scored_a.rows,
        row_records=scored_a.row_records,
        basis=basis,
    )
    calibration = result.bias
    assert calibration is not None  # rows were given
    fit, validation = split_by_sequence(
        scored_a.rows.sequence_id, settings.validation_fraction, settings.seed
    )
    cross_path, _ = fit_bias_for_serving(
        scored_a.rows.select(fit), scored_a.rows.select(validation), settings, basis
    )
    fit_seconds = time.monotonic() - fit_started
    policies = [result.profile.parameters.to_policy(rule) for rule in FITTED_RULES]
    cross_rules = quality_table(scored_b.records, policies, split="test")

    path, correction = calibration.path, calibration.correction
    cross = cross_path.chosen.correction
    at_one = result.profile.test_quality_by_request_temperature[request_temperatures.index(1.0)]
    in_text, in_doc = bias_section(
        "in-domain (test prompts of the shipped set)", at_one, calibration.test
    )
    cross_text, cross_doc = bias_section(
        "cross-domain (the formal prompt set; bias fitted on all shipped prompts; "
        f"{penalties_text(cross_path.chosen)}, T {cross.temperature:.3f})",
        cross_rules,
        bias_quality(scored_b.rows, cross),
    )
    stream_text, stream_doc = "", list[dict]()
    if args.stream_samples:
        stream_text, stream_doc = _streamed(
            scorer,
            pair,
            scored_a,
            calibration=calibration,
            settings=settings,
            basis=basis,
            args=args,
        )
    seconds = time.monotonic() - started
    section = (
        f"## {name} ({pair.served.describe()})\n\nwall time {seconds:.0f} s (fits "
        f"{fit_seconds:.0f} s); recommended temperature rule: "
        f"{result.profile.recommended_rule.value}; bias recommended: {calibration.recommended}, "
        f"{penalties_text(path.chosen)}, "
        f"T {correction.temperature:.3f}, max |b| {float(correction.bias.abs().max()):.2f}; "
        f"validation KL (1e-3) by head-span penalty: {_by_penalty(path.head_validation_kl)}; "
        f"by per-token penalty (inf: T only): {_by_penalty(path.validation_kl)}\n\n"
        f"{in_text}\n\n{cross_text}\n" + (f"\n{stream_text}\n" if stream_text else "")
    )
    document = {
        "family": name,
        "served": pair.served.describe(),
        "seconds": seconds,
        "bias_fit_seconds": fit_seconds,
        "recommended_rule": result.profile.recommended_rule.value,
        "bias_recommended": calibration.recommended,
        "head_basis": basis is not None,
        "penalty": path.chosen.penalty,
        "head_penalty": path.chosen.head_penalty,
        "bias_temperature": correction.temperature,
        "validation_kl_by_penalty": {str(p): kl for p, kl in path.validation_kl.items()},
        "validation_kl_by_head_penalty": {str(p): kl for p, kl in path.head_validation_kl.items()},
        "bias_fit_kl": path.chosen.fit_kl,
        "bias_fit_evaluations": path.chosen.evaluations,
        "cross_penalty": cross_path.chosen.penalty,
        "cross_head_penalty": cross_path.chosen.head_penalty,
        "cross_temperature": cross.temperature,
        "cross_validation_kl_by_penalty": {
            str(p): kl for p, kl in cross_path.validation_kl.items()
        },
        "in_domain": in_doc,
        "online_refinement": stream_doc,
        "cross_domain": cross_doc,
    }
    return section, document


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--samples", type=int, default=1, help="completions per shipped prompt")
    parser.add_argument("--cross-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--max-rows", type=int, default=4096, help="paired rows kept per domain (400 KB each)"
    )
    parser.add_argument("--families", default="int4", help=f"comma-separated of {list(FAMILIES)}")
    served_options(parser)
    parser.add_argument(
        "--per-token-only",
        action="store_true",
        help="fit the bias per token only, without its part in the output head's span",
    )
    parser.add_argument(
        "--stream-samples",
        type=int,
        default=0,
        help="rounds of in-domain traffic to refine the in-domain bias online with",
    )
    parser.add_argument(
        "--request-temperatures",
        type=float,
        nargs="+",
        default=[1.0],
        help="request temperatures the bias gets a band at (1.0 is always one); the streaming "
        "rounds report each",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    clean_path = ensure_default_model(Settings().cache_dir)
    families = [name for name in args.families.split(",") if name]
    pairs = served_pairs(families, served_checkpoints(args))
    header = (
        f"# Per-token bias + T beside the temperature rules on {clean_path.name}\n\n"
        f"{args.num_prompts} shipped prompts with {args.samples} completion(s) each (fit / "
        f"validation / test by prompt), {args.cross_prompts} formal prompts (cross-domain test), "
        f"completions of up to {args.max_new_tokens} tokens sampled from the served model, at "
        f"most {args.max_rows} paired rows per domain; {torch.get_num_threads()} "
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
