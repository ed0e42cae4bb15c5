"""Resident memory of the shadow scoring path in one process: the tiny pair's `PairScorer`
feeding an `OnlineEstimator` (a refit every 256 positions, window capped at 50 000), with
glibc's dynamic mmap threshold (default) or the fixed one `serve` sets (``--fixed``).
``--score-only`` leaves the estimator out. Prints RSS (MiB) every 500 scored sequences.

    PYTHONPATH=. .venv/bin/python experiments/estimator_heap.py [--fixed] [--score-only]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from noisy_temp_server.online.estimator import OnlineEstimator
from noisy_temp_server.online.heap import fix_mmap_threshold
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_model import build_tiny_llama


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixed", action="store_true", help="fix the mmap threshold first")
    parser.add_argument("--score-only", action="store_true", help="no online estimator")
    parser.add_argument("--sequences", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fixed:
        fix_mmap_threshold()
    root = Path(tempfile.mkdtemp())
    clean = AutoModelForCausalLM.from_pretrained(build_tiny_llama(root / "clean", seed=0))
    served = AutoModelForCausalLM.from_pretrained(build_tiny_llama(root / "served", seed=1))
    scorer = PairScorer(clean, served)
    estimator = OnlineEstimator(min_positions=256, refit_every=256)
    rng = random.Random(0)
    for i in range(args.sequences + 1):
        length = rng.randint(24, 60)
        tokens = [rng.randrange(200) for _ in range(length)]
        records = scorer.score_sequence(ScoringSequence(tokens, rng.randint(5, length - 16), i))
        if not args.score_only:
            estimator.add(records)
        if i % 500 == 0:
            print(f"{i} sequences: RSS {rss_mib():.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
