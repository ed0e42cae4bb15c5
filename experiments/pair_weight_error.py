"""How far a served model's decoder weights are from the clean ones, in the raw basis and in the
served model's basis (`adapter.smoothing.served_basis`): does the smoothing find the scales a
quantizer such as AWQ moved, so that what the adapter fits is the rounding error alone?

    PYTHONPATH=. .venv/bin/python experiments/pair_weight_error.py --served DIR
    PYTHONPATH=. .venv/bin/python experiments/pair_weight_error.py \\
        --spec '{"kind": "quantization", "format": "int4", "group_size": 64}'

Prints, per kind of decoder linear layer, the mean over blocks of ||W_served - W_clean||_F /
||W_clean||_F in both bases, and the range of the decoder norms' ratios w_clean / w_served
(1 where the quantizer left the norms alone), against the embedded default model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from pydantic import TypeAdapter

from noisy_temp_server.adapter.layer_fit import _decompress
from noisy_temp_server.adapter.smoothing import NORM_READERS, check_adaptable_pair, served_basis
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.loading import load_pair
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.settings import Settings

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _errors(clean: torch.nn.Module, served: torch.nn.Module) -> dict[str, float]:
    errors = {}
    for name in LINEARS:
        values = []
        for c, s in zip(clean.model.layers, served.model.layers, strict=True):
            wc = c.get_submodule(name).weight.float()
            ws = s.get_submodule(name).weight.float()
            values.append(float((ws - wc).norm() / wc.norm()))
        errors[name] = sum(values) / len(values)
    return errors


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--served", type=Path, help="a served model folder")
    how.add_argument("--spec", help="a perturbation spec (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clean_path = ensure_default_model(Settings().cache_dir)
    if args.served is not None:
        pair = load_pair(clean_path, served_path=args.served)
    else:
        spec = TypeAdapter(PerturbationSpec).validate_json(args.spec)
        pair = load_pair(clean_path, spec=spec)
    clean, served = pair.clean_model, pair.served_model
    _decompress(clean)
    _decompress(served)
    ratios = torch.cat(
        [
            c.get_submodule(norm).weight.float() / s.get_submodule(norm).weight.float()
            for c, s in zip(clean.model.layers, served.model.layers, strict=True)
            for norm, _ in NORM_READERS
        ]
    )
    print(
        f"{pair.served.describe()}: decoder norms' w_clean / w_served from "
        f"{float(ratios.min()):.3g} to {float(ratios.max()):.3g} (median "
        f"{float(ratios.median()):.3g})"
    )
    raw = _errors(clean, served)
    check_adaptable_pair(clean, served, "model.layers", len(clean.model.layers))
    with served_basis(clean.model.layers, served.model.layers) as smoothed:
        based = _errors(clean, served)
    print(f"smoothed: {smoothed}\n\n| layer | raw basis | served basis |\n|---|---:|---:|")
    for name in LINEARS:
        print(f"| {name} | {raw[name]:.4f} | {based[name]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
