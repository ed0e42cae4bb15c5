"""How much of the per-position oracle the in-domain bias reaches as it is fitted on more
distinct prompts of its domain (int4 on the embedded default model by default).

    .venv/bin/python experiments/bias_data_scaling.py [--family int4] [--max-new-tokens 48]
        [--extra-steps 0 79 158] [--head-penalty 1e-3] [--penalty 3.2e-4] [--threads N]

The served model writes one completion of each shipped prompt and of each prompt of
`experiments/data/prompts_shipped_style.jsonl` (158 more prompts written in the shipped set's
style, many on its templates: the same domain, none of its texts); the pair scorer keeps
every position's row. The shipped prompts are split as calibration splits them
(as `bias_quality.py` splits them for its in-domain figures: fit, validation and test by
prompt); the test prompts are held out
throughout. For each k of `--extra-steps`, the bias + T is fitted on the shipped fit and
validation prompts plus the first k extra prompts, as `fit_logit_bias` fits it (the head-span
part first, then the per-token part with the head-span part refitted) but at fixed penalties
(default: those int4 calibration chose in `bias_quality.py`, so that only the data changes),
and measured on the shipped test prompts beside T = 1 and the per-position oracle T on the
same rows. A control fit has as many rows as the fit on the shipped prompts alone, evenly
thinned from every prompt's: more prompts, not more rows. Writes
experiments/results/bias_data_scaling.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from bias_quality import scored_completions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # quality.py

from quality import FAMILIES

from noisy_temp_server.calibration.bias_quality import bias_quality
from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import split_fit_validation_test
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import load_pair
from noisy_temp_server.correction.bias import BiasFit, fit_bias_at_penalty
from noisy_temp_server.correction.paired_rows import PairedRows
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.settings import Settings

HERE = Path(__file__).resolve().parent
EXTRA_PROMPTS = HERE / "data" / "prompts_shipped_style.jsonl"
RESULTS = HERE / "results"


def _fit(
    rows: PairedRows, basis: torch.Tensor | None, head_penalty: float, penalty: float
) -> BiasFit:
    """`fit_logit_bias`'s two stages at one pair of penalties."""
    head = fit_bias_at_penalty(
        rows, math.inf, basis=basis, head_penalty=head_penalty, fit_bias=False
    )
    return fit_bias_at_penalty(rows, penalty, basis=basis, head_penalty=head_penalty, start=head)


def _step(
    fit_rows: PairedRows,
    test_rows: PairedRows,
    prompts: int,
    args: argparse.Namespace,
    basis: torch.Tensor | None,
) -> dict:
    """The bias fitted on `fit_rows` (of `prompts` prompts), measured on `test_rows`."""
    started = time.monotonic()
    correction = _fit(fit_rows, basis, args.head_penalty, args.penalty).correction
    quality = bias_quality(test_rows, correction)
    one = quality.t_one.mean_kl
    return {
        "fit_prompts": prompts,
        "fit_rows": len(fit_rows),
        "temperature": correction.temperature,
        "share_removed": quality.share_removed,
        "share_stderr": quality.row.gain_stderr / one,
        "oracle_share": quality.oracle.gain / one,
        "same_top_rate": quality.same_top_rate,
        "same_top_rate_t_one": quality.same_top_rate_t_one,
        "fit_seconds": time.monotonic() - started,
    }


def _line(step: dict) -> str:
    return (
        f"| {step['fit_prompts']} | {step['fit_rows']} | {step['temperature']:.3f} | "
        f"{100 * step['share_removed']:+.1f} % ± {100 * step['share_stderr']:.1f} | "
        f"{100 * step['oracle_share']:+.1f} % | {100 * step['same_top_rate_t_one']:.1f} → "
        f"{100 * step['same_top_rate']:.1f} % | {step['fit_seconds']:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=list(FAMILIES), default="int4")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--extra-steps", type=int, nargs="+", default=[0, 79, 158])
    fixed = "default: what int4's calibration chose in bias_quality.py; give a family's own"
    parser.add_argument("--head-penalty", type=float, default=1e-3, help=fixed)
    parser.add_argument("--penalty", type=float, default=3.2e-4, help=fixed)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    pair = load_pair(ensure_default_model(Settings().cache_dir), spec=FAMILIES[args.family])
    scorer = PairScorer(pair.clean_model, pair.served_model, runtime_noise=pair.runtime_noise)
    shipped_prompts, extra_prompts = load_prompts(), load_prompts(EXTRA_PROMPTS)
    if max(args.extra_steps) > len(extra_prompts):
        parser.error(f"--extra-steps: at most {len(extra_prompts)} extra prompts")
    shipped, extra = (
        scored_completions(
            scorer,
            pair,
            prompts,
            max_new_tokens=args.max_new_tokens,
            max_rows=None,
            samples=1,
            first_id=first_id,
        ).rows
        for prompts, first_id in ((shipped_prompts, 0), (extra_prompts, len(shipped_prompts)))
    )
    settings = CalibrationSettings(  # the split of bias_quality.py's in-domain figures
        prompts=len(shipped_prompts), validation_fraction=0.2, test_fraction=0.3
    )
    fit, validation, test = split_fit_validation_test(
        shipped.sequence_id, settings.validation_fraction, settings.test_fraction, settings.seed
    )
    own, test_rows = shipped.select(fit | validation), shipped.select(test)
    own_prompts = int(torch.unique(own.sequence_id).numel())
    basis = pair.head_basis(shipped.vocab_size)
    steps = []
    for k in sorted(args.extra_steps):
        added = extra.select(extra.sequence_id < len(shipped_prompts) + k)
        steps.append(
            _step(PairedRows.concat([own, added]), test_rows, own_prompts + k, args, basis)
        )
        print(_line(steps[-1]), flush=True)
    every = PairedRows.concat([own, extra])
    thinned = every.select(torch.arange(len(every)) % round(len(every) / len(own)) == 0)
    control = _step(thinned, test_rows, own_prompts + len(extra_prompts), args, basis)
    print(_line(control), flush=True)
    test_prompts = int(torch.unique(test_rows.sequence_id).numel())
    text = (
        f"# The in-domain bias against the number of prompts it is fitted on "
        f"({pair.served.describe()})\n\n"
        f"Test: {len(test_rows)} positions of {test_prompts} shipped prompts no fit saw; one "
        f"completion of up to {args.max_new_tokens} tokens per prompt; head-span penalty "
        f"{args.head_penalty:g}, per-token penalty {args.penalty:g}; "
        f"{torch.get_num_threads()} torch threads; wall time "
        f"{time.monotonic() - started:.0f} s. Share of KL(T = 1) removed ± s.e. clustered by "
        "prompt.\n\n| fit prompts | fit rows | T | bias + T | per-position oracle T | same top "
        "token (T = 1 → bias) | fit s |\n|---:|---:|---:|---:|---:|---:|---:|\n"
        + "\n".join(_line(step) for step in steps)
        + "\n\nControl, as many rows as the fit on the shipped prompts alone, evenly spread over "
        "every prompt:\n\n" + _line(control) + "\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bias_data_scaling.md").write_text(text)
    (args.out / "bias_data_scaling.json").write_text(
        json.dumps(
            {
                "family": args.family,
                "served": pair.served.describe(),
                "steps": steps,
                "same_rows_every_prompt": control,
            },
            indent=2,
        )
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
