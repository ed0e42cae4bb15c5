"""The shadow scorer's own cost and the online estimate it feeds, on the default pair.

Completions are sampled from the served model of the default pair (the embedded
SmolLM2-135M-Instruct with ``serve``'s default perturbation, or ``--perturbation``) on the
shipped prompts, then scored teacher-forced, with ``--threads`` torch threads (default 1: the
serving default ``shadow_threads``):

- speed: scored completion tokens per CPU-second (per core, from the process's CPU time, so a
  shared machine slows the wall clock but not the figure) of the offline records
  (`PairScorer.score_sequence`: clean and served passes, per-position oracle and KL curve, what
  `calibrate` keeps) and of the online path as ``serve`` runs it (the scorer `pair_scorer`
  builds, clean model only, `PairScorer.score_live` fed the served rows the engine captures:
  here the served model's rows with the pair's runtime noise, computed beforehand, since in
  serving the engine computes them anyway), with the records' KL curves (what an estimator
  that refits a rule's T reads) and without (what ``serve`` computes when its estimator refits
  only alpha / sigma2, e.g. from the shipped default-pair profile, whose banded calibrated
  table is kept: reported as ``serve_reads_kl_curves``), each the median of ``--repeats``
  passes over the same sequences; the last also at request temperature 0.7 (its scores
  against softmax(z/0.7) need one more softmax pass per side of each position);
- accuracy: alpha of the online estimator (`OnlineEstimator`, fed request by request until
  its first published policy, after at most ``--online-positions`` positions) against the
  offline alpha of the same pair (`noise_by_step` on the records of every sampled position),
  by step bucket and pooled.

Figures go to stdout and, as JSON, to ``benchmarks/results/``. Run it on a quiet
machine (other processes change the speed figures):

    .venv/bin/python benchmarks/online_scoring.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from noisy_temp_server.calibration.fitting import noise_by_step
from noisy_temp_server.calibration.prompts import encode_prompt, load_prompts
from noisy_temp_server.checkpoints.loading import load_pair
from noisy_temp_server.online.estimator import OnlineEstimator
from noisy_temp_server.online.startup import pair_scorer, startup_profile
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.sampling import generate_completions
from noisy_temp_server.scoring.scorer import PairScorer, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.server.launch import resolve_pair
from noisy_temp_server.settings import Settings

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _tokens_per_second(
    score: Any, sequences: list[ScoringSequence], repeats: int
) -> tuple[float, int]:
    tokens = sum(len(s.token_ids) - s.prompt_length for s in sequences)
    score(sequences[0])  # warm-up
    times = []
    for _ in range(repeats):
        started = time.process_time()
        for sequence in sequences:
            score(sequence)
        times.append(time.process_time() - started)
    return tokens / statistics.median(times), tokens


def _captured(scorer: PairScorer, sequence: ScoringSequence, positions: int) -> ServedRows:
    """What the engine captures of `sequence`: the served rows (runtime noise included) of its
    first `positions` steps."""
    rows = torch.cat([served for _, _, served in scorer.logit_chunks(sequence)])[:positions]
    return ServedRows(torch.arange(rows.shape[0]), rows)


def _pooled_alpha(records: PositionRecords) -> float:
    finite = torch.isfinite(records.sigma2) & torch.isfinite(records.tau2)
    return float(records.sigma2[finite].double().mean() / records.tau2[finite].double().mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--perturbation", default=Settings().perturbation, help="the pair (default: serve's)"
    )
    parser.add_argument("--prompts", type=int, default=32, help="completions sampled")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="as NTS_SHADOW_THREADS")
    parser.add_argument("--speed-sequences", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--online-positions", type=int, default=2000)
    parser.add_argument(
        "--offline-only",
        action="store_true",
        help="only the offline records' speed (to measure a checkout from before score_live)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    settings = Settings(perturbation=args.perturbation)
    pair = resolve_pair(settings)
    live_scorer = pair_scorer(settings, pair)  # the scorer `serve` builds: clean model only
    assert pair.clean is not None
    loaded = load_pair(pair.clean, served_path=pair.served)
    scorer = PairScorer(loaded.clean_model, loaded.served_model, runtime_noise=pair.runtime_noise)
    tokenizer = AutoTokenizer.from_pretrained(pair.served, local_files_only=True)
    prompts = [encode_prompt(tokenizer, p) for p in load_prompts()][: args.prompts]
    started = time.perf_counter()
    sequences = generate_completions(
        loaded.served_model,
        tokenizer,
        prompts,
        max_new_tokens=args.max_tokens,
        seed=0,
        runtime_noise=pair.runtime_noise,
    )
    print(f"sampled {len(sequences)} completions in {time.perf_counter() - started:.0f} s")

    speed_set = sequences[: args.speed_sequences]
    offline_rate, speed_tokens = _tokens_per_second(scorer.score_sequence, speed_set, args.repeats)
    if args.offline_only:
        print(
            json.dumps({"offline_records_tokens_per_cpu_s": offline_rate, "tokens": speed_tokens})
        )
        return 0
    positions = settings.capture_positions
    captured = {s.sequence_id: _captured(scorer, s, positions) for s in sequences}
    live_set = [s for s in speed_set if len(s.token_ids) - s.prompt_length <= positions]
    rates = {}
    variants = {  # name: (KL curves, request temperature)
        "online_live_captured": (True, 1.0),
        "online_live_without_kl_curves": (False, 1.0),
        "online_live_without_kl_curves_at_request_temperature_0.7": (False, 0.7),
    }
    for name, (kl_curve, request_temperature) in variants.items():
        rates[name], live_tokens = _tokens_per_second(
            lambda s, curve=kl_curve, t_r=request_temperature: live_scorer.score_live(
                s,
                [1.0] * positions,
                captured[s.sequence_id],
                request_temperature=t_r,
                kl_curve=curve,
            ),
            live_set,
            args.repeats,
        )
    per_core = {"offline_records": offline_rate, **rates}
    profile = startup_profile(settings, pair).profile
    serve_reads_kl_curves = OnlineEstimator(profile).reads_kl_curves

    records = scorer.score(sequences)
    estimator = OnlineEstimator(
        min_positions=settings.shadow_min_positions, refit_every=settings.shadow_min_positions
    )
    fed = 0
    for sequence in sequences:
        if estimator.current_policy().version > 0 or fed >= args.online_positions:
            break
        live = live_scorer.score_live(
            sequence, [], captured[sequence.sequence_id], request_temperature=1.0
        )
        estimator.add(live.records)
        fed += len(live.records)
    policy = estimator.current_policy()
    offline_noise = noise_by_step(records, policy.step_edges)
    online = dict(zip(policy.step_edges, policy.alpha_by_step, strict=True))
    buckets = [
        {
            "step_start": n.step_start,
            "offline_positions": n.positions,
            "offline_alpha": n.alpha,
            "online_alpha": online[n.step_start],
            "relative_difference": online[n.step_start] / n.alpha - 1 if n.alpha else None,
        }
        for n in offline_noise
        if n.positions
    ]
    online_records = PositionRecords.concat(
        [
            records.select(records.sequence_id == s.sequence_id).select(
                torch.arange(len(captured[s.sequence_id].steps))
            )
            for s in sequences
        ]
    ).select(torch.arange(fed))
    document = {
        "command": " ".join(["benchmarks/online_scoring.py", *sys.argv[1:]]),
        "machine": f"{platform.platform()} ({os.cpu_count()} CPUs)",
        "load_average": os.getloadavg()[0],
        "timestamp": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
        "threads": args.threads,
        "speed_tokens": {"offline": speed_tokens, "online": live_tokens},
        "capture_positions": positions,
        "scored_tokens_per_s_per_core": per_core,
        "clean_dtype": settings.clean_dtype,
        "serve_reads_kl_curves": serve_reads_kl_curves,
        "speedup": per_core["online_live_captured"] / per_core["offline_records"],
        "positions_total": len(records),
        "online_positions_at_first_policy": fed,
        "online_policy_version": policy.version,
        "alpha_pooled_offline": _pooled_alpha(records),
        "alpha_pooled_online": _pooled_alpha(online_records),
        "alpha_by_step_bucket": buckets,
    }
    text = json.dumps(document, indent=2)
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"online-scoring-{document['timestamp']}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
