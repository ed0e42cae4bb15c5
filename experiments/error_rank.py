"""How low-rank is each layer's weight error as the layer's inputs see it, and how much of those
inputs' energy sits at a few positions? Why a rank-16 adapter removes less of AWQ's KL than of
RTN's at the same format (docs/quality.md#real-quantizers).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice .venv/bin/python experiments/error_rank.py \\
        --served awq=DIR --served gptq=DIR \\
        --spec rtn-g64='{"kind": "quantization", "format": "int4", "group_size": 64}' \\
        --prompt-file benchmarks/data/prompts_formal.jsonl --prompts 24 --new-tokens 48 \\
        --out experiments/results/error_rank_formal.md

For each pair, on the first `--prompts` prompts (default: the shipped set) with the clean
model's greedy completions: each decoder linear layer's error E = W_clean - W_served in the
served model's basis (`adapter.smoothing.served_basis`) and the second moment C of its inputs in
the served model; the input-weighted error energy tr(E C E^T) = ||E L||_F^2 (L L^T = C ridged as
the fit truncates, `TRUNCATION_RIDGE`), relative to the clean output energy tr(W C W^T); the
share of it in the top 16 and 64 singular directions of E L (what an adapter of that rank can
capture) and the energy those leave; the same top-16 share with each sequence's first position
left out of C; the share of the error energy and of tr(C) at the first positions, and of tr(C)
at the top 1 % of positions. Then, over all layers, the share a uniform rank's parameters
capture when allocated to the largest energy per parameter (`_allocated_share`). The table
(means over blocks) goes to `--out`, every block's row beside it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from pair_weight_error import LINEARS
from pydantic import TypeAdapter
from torch import Tensor

from noisy_temp_server.adapter.deltas import TRUNCATION_RIDGE
from noisy_temp_server.adapter.layer_fit import _decompress, _hooked
from noisy_temp_server.adapter.smoothing import served_basis
from noisy_temp_server.calibration.prompts import encode_prompt, load_prompts
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.settings import Settings

RANKS = (16, 64)
COLUMNS = (
    "error energy / output energy (1e-3)",
    "top-16 share",
    "top-64 share",
    "left by top 16 (1e-3)",
    "top-16 share, first position out",
    "error energy at first positions",
    "tr(C) from first positions",
    "tr(C) from top 1 % positions",
)


@torch.no_grad()
def _sequences(
    pair: LoadedPair, prompt_file: Path | None, prompts: int, new_tokens: int
) -> list[Tensor]:
    """The first `prompts` prompts, each with the clean model's greedy completion."""
    out = []
    for prompt in load_prompts(prompt_file)[:prompts]:
        ids = torch.tensor([encode_prompt(pair.tokenizer, prompt)])
        out.append(
            pair.clean_model.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        )
    return out


@torch.no_grad()
def _inputs(model: torch.nn.Module, sequences: list[Tensor]) -> dict[str, list[Tensor]]:
    """Each decoder linear layer's inputs in `model`, one [tokens, in] tensor per sequence."""
    modules = {
        f"{i}.{name}": block.get_submodule(name)
        for i, block in enumerate(model.model.layers)
        for name in LINEARS
    }
    captured: dict[str, list[Tensor]] = defaultdict(list)

    def keep(name: str, x: Tensor, _: Tensor) -> None:
        captured[name].append(x[0].float())

    with _hooked(modules, keep):
        for ids in sequences:
            model(input_ids=ids, use_cache=False)
    return captured


def _spectrum(error: Tensor, moment: Tensor) -> Tensor:
    """The squared singular values of E L, largest first: their sum is ||E L||^2."""
    ridged = moment + TRUNCATION_RIDGE * moment.diagonal().mean() * torch.eye(len(moment)).double()
    return torch.linalg.svdvals(error @ torch.linalg.cholesky(ridged)) ** 2


def _top_shares(error: Tensor, moment: Tensor) -> tuple[float, list[float]]:
    """(||E L||^2, share of it in the top RANKS singular directions of E L)."""
    values = _spectrum(error, moment)
    total = float(values.sum())
    return total, [float(values[:r].sum()) / total for r in RANKS]


def _layer_row(clean_w: Tensor, served_w: Tensor, xs: list[Tensor]) -> tuple[list[float], Tensor]:
    """The layer's COLUMNS and its spectrum in the first column's units (1e-3 of tr(W C W^T))."""
    xs = [x.double() for x in xs]
    rows = torch.cat(xs)
    moment = rows.T @ rows / len(rows)
    rest = torch.cat([x[1:] for x in xs])
    error = clean_w.double() - served_w.double()
    spectrum = _spectrum(error, moment)
    energy = float(spectrum.sum())
    shares = [float(spectrum[:r].sum()) / energy for r in RANKS]
    _, rest_shares = _top_shares(error, rest.T @ rest / len(rest))
    output = float(((clean_w.double() @ moment) * clean_w.double()).sum())
    first_error = sum(float(((x[0] @ error.T) ** 2).sum()) for x in xs) / (energy * len(rows))
    norms = (rows**2).sum(dim=1)
    first = sum(float((x[0] ** 2).sum()) for x in xs)
    top = float(norms.topk(max(1, len(norms) // 100)).values.sum())
    total = float(norms.sum())
    relative = energy / output
    row = [
        1e3 * relative,
        shares[0],
        shares[1],
        1e3 * relative * (1 - shares[0]),
        rest_shares[0],
        first_error,
        first / total,
        top / total,
    ]
    return row, 1e3 * spectrum / output


@torch.no_grad()
def measure(
    pair: LoadedPair, sequences: list[Tensor]
) -> tuple[dict[str, list[list[float]]], list[tuple[Tensor, int]]]:
    """({layer kind: one row of COLUMNS per decoder block}, each layer's spectrum (`_layer_row`)
    with its adapter parameters per rank, in + out)."""
    clean, served = pair.clean_model, pair.served_model
    _decompress(clean)
    _decompress(served)
    inputs = _inputs(served, sequences)
    rows: dict[str, list[list[float]]] = {name: [] for name in LINEARS}
    spectra = []
    with served_basis(clean.model.layers, served.model.layers):
        for i, (c, s) in enumerate(zip(clean.model.layers, served.model.layers, strict=True)):
            for name in LINEARS:
                clean_w, served_w = c.get_submodule(name).weight, s.get_submodule(name).weight
                row, spectrum = _layer_row(clean_w, served_w, inputs[f"{i}.{name}"])
                rows[name].append(row)
                spectra.append((spectrum, sum(clean_w.shape)))
    return rows, spectra


def _allocated_share(spectra: list[tuple[Tensor, int]], rank: int) -> float:
    """The share of all layers' error energy captured when the parameters of a uniform rank
    `rank` go, direction by direction, to the largest energy per parameter in any layer."""
    values = torch.cat([spectrum for spectrum, _ in spectra])
    costs = torch.cat([torch.full_like(spectrum, cost) for spectrum, cost in spectra])
    order = torch.argsort(values / costs, descending=True)
    kept = torch.cumsum(costs[order], 0) <= rank * sum(cost for _, cost in spectra)
    return float(values[order][kept].sum() / values.sum())


def _table_rows(name: str, rows: dict[str, list[list[float]]]) -> list[str]:
    """Each layer kind's mean over the blocks, then all layers: the energies summed, the top-16
    share 1 - left / energy."""
    lines = []
    for layer, blocks in rows.items():
        mean = [sum(column) / len(column) for column in zip(*blocks, strict=True)]
        lines.append(f"| {name} | {layer} | " + " | ".join(f"{v:.3f}" for v in mean) + " |")
    every = [row for blocks in rows.values() for row in blocks]
    energy = sum(row[0] for row in every)
    top = [sum(row[0] * row[1 + i] for row in every) / energy for i in range(len(RANKS))]
    lines.append(
        f"| {name} | all {len(every)} layers (sums) | {energy:.1f} | {top[0]:.3f} | {top[1]:.3f} "
        f"| {energy * (1 - top[0]):.1f} |" + " |" * (len(COLUMNS) - 4)
    )
    return lines


def _pair_argument(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--served", type=_pair_argument, action="append", default=[])
    parser.add_argument("--spec", type=_pair_argument, action="append", default=[])
    parser.add_argument("--prompt-file", type=Path, default=None, help="default: the shipped set")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clean_path = ensure_default_model(Settings().cache_dir)
    pairs = [(name, {"served_path": Path(folder).expanduser()}) for name, folder in args.served]
    pairs += [
        (name, {"spec": TypeAdapter(PerturbationSpec).validate_json(spec)})
        for name, spec in args.spec
    ]
    sequences: list[Tensor] = []
    every: dict[str, dict[str, list[list[float]]]] = {}
    allocated: dict[str, list[float]] = {}
    lines = [
        f"{args.prompts} prompts of {args.prompt_file or 'the shipped set'} with the clean "
        f"model's greedy completions of {args.new_tokens} tokens; means over the decoder blocks.\n",
        "| pair | layer | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for name, how in pairs:
        pair = load_pair(clean_path, **how)
        sequences = sequences or _sequences(pair, args.prompt_file, args.prompts, args.new_tokens)
        every[name], spectra = measure(pair, sequences)
        lines += _table_rows(name, every[name])
        allocated[name] = [_allocated_share(spectra, rank) for rank in RANKS]
        print("\n".join(lines[-len(LINEARS) - 1 :]), allocated[name], flush=True)
        del pair
    lines += [
        "\nAll layers' error energy captured by the parameters of a uniform rank, allocated by "
        "energy per parameter (`_allocated_share`):\n",
        "| pair | " + " | ".join(f"rank {r}" for r in RANKS) + " |",
        "|---|" + "---:|" * len(RANKS),
        *(f"| {n} | " + " | ".join(f"{v:.3f}" for v in a) + " |" for n, a in allocated.items()),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps({"columns": COLUMNS, "rows": every, "allocated": allocated})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
