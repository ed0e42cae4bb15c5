"""Does giving each layer the rank its error needs, at a uniform rank's parameter count, remove
more KL than the uniform rank? An end-to-end check of `error_rank.py`'s per-layer allocation.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice .venv/bin/python experiments/rank_allocation.py \\
        --served awq=DIR --ridge 30 --out experiments/results/rank_allocation_awq.md

One pair (`--served NAME=DIR` or `--spec NAME=JSON`): the served model samples one completion
(T = 1) of each of the first `--fit-prompts` shipped prompts and of each formal prompt (the test,
another domain), as `adapter_methods.py` does. A `propagated` adapter of rank `--fit-rank` is
fitted on the fit sequences; each layer's delta D is then cut down in the weighting its fit
truncates in (the SVD of D L, L L^T the served inputs' second moment C on the fit sequences,
ridged by `TRUNCATION_RIDGE`), either to `--budget-rank` in every layer or to ranks chosen by
the largest energy per parameter across layers (energy in units of the layer's output energy
tr(W C W^T), as `error_rank.py` allocates) within the same parameter count. Reports the share of
KL(T = 1) removed on the test by the fitted adapter and by both cuts, and their paired
difference (prompt-clustered s.e.), with the allocated ranks per layer kind.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from error_rank import _pair_argument
from pydantic import TypeAdapter
from torch import Tensor

from noisy_temp_server.adapter.deltas import TRUNCATION_RIDGE
from noisy_temp_server.adapter.layer_fit import (
    _decompress,
    _hooked,
    applied_deltas,
    fit_compensation_adapter,
)
from noisy_temp_server.adapter.lora import LoraAdapter, LowRankDelta
from noisy_temp_server.calibration.completions import sample_completions
from noisy_temp_server.calibration.prompts import load_prompts
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.settings import Settings

FORMAL_PROMPTS = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "prompts_formal.jsonl"
)


@torch.no_grad()
def _moments(model: torch.nn.Module, names: list[str], sequences: list[ScoringSequence]) -> dict:
    """{layer: X^T X / n} of each named layer's inputs in `model` on `sequences`."""
    modules = dict(model.named_modules())
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = defaultdict(int)

    def accumulate(name: str, x: Tensor, _: Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).double()
        sums[name] = sums.get(name, 0) + rows.T @ rows
        counts[name] += len(rows)

    with _hooked({n: modules[n] for n in names}, accumulate):
        for sequence in sequences:
            model(input_ids=torch.tensor([sequence.token_ids]), use_cache=False)
    return {n: sums[n] / counts[n] for n in names}


def _cuts(adapter: LoraAdapter, served: torch.nn.Module, moments: dict, rank: int) -> tuple:
    """(uniform, allocated, {layer: allocated rank}): each layer's delta truncated in its C
    weighting to `rank`, and to the ranks of the greedy energy-per-parameter allocation."""
    modules = dict(served.named_modules())
    parts = {}
    for name, delta in adapter.layers.items():
        moment = moments[name]
        lower = torch.linalg.cholesky(
            moment + TRUNCATION_RIDGE * moment.diagonal().mean() * torch.eye(len(moment)).double()
        )
        u, s, vh = torch.linalg.svd(delta.dense().double() @ lower, full_matrices=False)
        weight = modules[name].weight.detach().double()
        output = float(((weight @ moment) * weight).sum())
        parts[name] = (u, s, vh, lower, s**2 / output, sum(delta.shape))
    values = torch.cat([p[4][: adapter.rank] for p in parts.values()])
    costs = torch.cat([torch.full((adapter.rank,), float(p[5])) for p in parts.values()])
    owner = [name for name in parts for _ in range(adapter.rank)]
    order = torch.argsort(values / costs, descending=True)
    kept = torch.cumsum(costs[order], 0) <= rank * sum(p[5] for p in parts.values())
    ranks = dict.fromkeys(parts, 0)
    for index in order[kept].tolist():
        ranks[owner[index]] += 1

    def cut(name: str, r: int) -> LowRankDelta:
        u, s, vh, lower, _, _ = parts[name]
        down = torch.linalg.solve_triangular(lower, vh[:r], upper=False, left=False)
        return LowRankDelta(down=down.float().contiguous(), up=(u[:, :r] * s[:r]).float())

    uniform = {name: cut(name, rank) for name in parts}
    allocated = {name: cut(name, r) for name, r in ranks.items() if r}
    return uniform, allocated, ranks


def _kl(pair: LoadedPair, test: list[ScoringSequence], layers: dict) -> tuple[Tensor, Tensor]:
    """KL(clean || served + `layers`' deltas) at T = 1 per test position, with its sequence ids."""
    scorer = PairScorer(pair.clean_model, pair.served_model, runtime_noise=None, device="cpu")
    with applied_deltas(pair.served_model, layers):
        records = scorer.score(test)
    return records.kl_at_one.double(), records.sequence_id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--served", type=_pair_argument)
    how.add_argument("--spec", type=_pair_argument)
    parser.add_argument("--fit-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--ridge", type=float, default=30.0)
    parser.add_argument("--fit-rank", type=int, default=64)
    parser.add_argument("--budget-rank", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clean_path = ensure_default_model(Settings().cache_dir)
    if args.served:
        name, folder = args.served
        pair = load_pair(clean_path, served_path=Path(folder).expanduser())
    else:
        name, spec = args.spec
        pair = load_pair(clean_path, spec=TypeAdapter(PerturbationSpec).validate_json(spec))
    _decompress(pair.served_model)
    fit = sample_completions(
        pair, load_prompts()[: args.fit_prompts], max_new_tokens=args.max_new_tokens, seed=0
    )
    test = sample_completions(
        pair, load_prompts(FORMAL_PROMPTS), max_new_tokens=args.max_new_tokens, seed=1
    )
    adapter = fit_compensation_adapter(
        pair.clean_model, pair.served_model, fit, rank=args.fit_rank, ridge=args.ridge
    )
    moments = _moments(pair.served_model, list(adapter.layers), fit)
    uniform, allocated, ranks = _cuts(adapter, pair.served_model, moments, args.budget_rank)
    base, ids = _kl(pair, test, {})
    kl_one = float(base.mean())
    kls = {
        f"fitted rank {args.fit_rank}": _kl(pair, test, dict(adapter.layers))[0],
        f"uniform rank {args.budget_rank}": _kl(pair, test, uniform)[0],
        f"allocated, rank {args.budget_rank}'s parameters": _kl(pair, test, allocated)[0],
    }
    lines = [
        f"# Rank allocation, {name} (propagated, ridge {args.ridge:g})\n",
        f"Fit: {args.fit_prompts} shipped prompts; test: the {len(test)} formal prompts "
        f"({len(base)} positions), KL(T = 1) {1e3 * kl_one:.1f} × 10⁻³ nats.\n",
        "| adapter | KL (1e-3) | share removed ± s.e. |",
        "|---|---:|---:|",
    ]
    for label, kl in kls.items():
        gain = base - kl
        lines.append(
            f"| {label} | {1e3 * float(kl.mean()):.1f} | {100 * float(gain.mean()) / kl_one:.1f} % "
            f"± {100 * cluster_stderr(gain, ids) / kl_one:.1f} |"
        )
    uniform_kl, allocated_kl = list(kls.values())[1:]
    difference = uniform_kl - allocated_kl
    by_kind: dict[str, list[int]] = defaultdict(list)
    for layer, r in ranks.items():
        by_kind[layer.rsplit(".", 1)[-1]].append(r)
    lines += [
        f"\nAllocated minus uniform: {100 * float(difference.mean()) / kl_one:+.2f} % ± "
        f"{100 * cluster_stderr(difference, ids) / kl_one:.2f} of KL(T = 1) (paired).\n",
        "Allocated ranks per layer kind (mean, min-max over blocks): "
        + "; ".join(
            f"{kind} {sum(rs) / len(rs):.1f} ({min(rs)}-{max(rs)})" for kind, rs in by_kind.items()
        ),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
