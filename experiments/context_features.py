"""Does context beyond the request-temperature band pay? A small log-linear model of T* from
what the served row shows for free, fitted by KL on paired records, against the band constant.

    .venv/bin/python benchmarks/quality.py --families logit-noise int4 --records DIR ...
    .venv/bin/python experiments/context_features.py --records DIR [--families logit-noise int4]

Reads the fit / validation / test records `benchmarks/quality.py --records DIR` saved (the
calibration pipeline's three prompt splits, every position at T_r = 0.5, 0.7, 1.0, 1.2). Per
family it fits, on the fit prompts, by minimising the mean interpolated KL of the records' KL
curves (damped Newton on the curves' analytic slope and curvature in log T):

- `band const`: log T* = c_band, one constant per request temperature (the calibrated rule's
  band roots before their gate);
- `shared`: log T* = c_band + w . x, x the standardised features served entropy, top-token
  probability, log Var_q and log(1 + step), w shared by the bands (4 + 4 parameters);
- `per band`: log T* = c_band + w_band . x (4 + 16 parameters).

The top-2 margin is not among the features: the records do not keep it. A model is *kept*
when its paired gain over the band constant on the validation prompts is significant (mean
minus 2 clustered standard errors > 0); its test figures are reported either way: closure of
the T* = 1 -> per-position-oracle gap and the paired test gain over the band constant
(± clustered s.e.), pooled over the request temperatures. Writes
experiments/results/context_features.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from noisy_temp_server.calibration.fitting import finite_positions
from noisy_temp_server.calibration.significance import is_significant
from noisy_temp_server.scoring.records import KLCurveInterpolant, PositionRecords
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.temperature.rules import TemperatureBounds

RESULTS = Path(__file__).resolve().parent / "results"
FEATURES = ("entropy", "top_prob", "log_var_q", "log1p_step")
BOUNDS = TemperatureBounds()
_NEWTON_STEPS = 60
_RIDGE = 1e-9


def _raw_features(records: PositionRecords) -> Tensor:
    """[N, 4] float64: the served-row features of `FEATURES`."""
    return torch.stack(
        [
            records.served_entropy.double(),
            records.served_top_prob.double(),
            records.served_var.double().clamp(min=1e-8).log(),
            records.step.double().clamp(min=0).log1p(),
        ],
        dim=1,
    )


def _band_onehot(records: PositionRecords, bands: Tensor) -> Tensor:
    """[N, B] float64: which request temperature of `bands` each position was measured at."""
    return (records.request_temperature.double()[:, None] - bands[None, :]).abs().lt(1e-4).double()


Design = Callable[[PositionRecords], Tensor]


def _designs(fit: PositionRecords) -> dict[str, Design]:
    """The models' design matrices (log T* = design @ theta), standardised on `fit`."""
    bands = torch.unique(fit.request_temperature.double())
    raw = _raw_features(fit)
    mean, std = raw.mean(dim=0), raw.std(dim=0).clamp(min=1e-12)

    def band_const(records: PositionRecords) -> Tensor:
        return _band_onehot(records, bands)

    def shared(records: PositionRecords) -> Tensor:
        x = (_raw_features(records) - mean) / std
        return torch.cat([_band_onehot(records, bands), x], dim=1)

    def per_band(records: PositionRecords) -> Tensor:
        onehot = _band_onehot(records, bands)
        x = (_raw_features(records) - mean) / std
        return torch.cat([onehot, (onehot[:, :, None] * x[:, None, :]).flatten(1)], dim=1)

    return {"band const": band_const, "shared": shared, "per band": per_band}


def _log_t(design: Tensor, theta: Tensor) -> Tensor:
    return (design @ theta).clamp(math.log(BOUNDS.t_min), math.log(BOUNDS.t_max))


def _fit(records: PositionRecords, design: Tensor) -> Tensor:
    """theta minimising the mean interpolated KL at log T = design @ theta (damped Newton with
    a backtracking line search, from theta = 0, i.e. T = 1)."""
    curves = KLCurveInterpolant(records.kl_curve, records.curve_temperatures)
    theta = torch.zeros(design.shape[1], dtype=torch.float64)
    value = float(curves.at(_log_t(design, theta))[0].mean())
    for _ in range(_NEWTON_STEPS):
        _, slope, curvature = curves.at(_log_t(design, theta))
        gradient = design.T @ slope / len(records)
        hessian = design.T @ (design * curvature.clamp(min=0.0)[:, None]) / len(records)
        hessian += (_RIDGE + 1e-6 * hessian.diagonal().mean()) * torch.eye(len(theta))
        step = torch.linalg.solve(hessian, gradient)
        size = 1.0
        while size > 1e-4:
            candidate = theta - size * step
            candidate_value = float(curves.at(_log_t(design, candidate))[0].mean())
            if candidate_value < value:
                break
            size /= 2
        else:
            break
        improvement = value - candidate_value
        theta, value = candidate, candidate_value
        if improvement < 1e-10 * max(value, 1e-12):
            break
    return theta


def _kl(records: PositionRecords, log_t: Tensor) -> Tensor:
    return KLCurveInterpolant(records.kl_curve, records.curve_temperatures).at(log_t)[0]


def _paired(gain: Tensor, records: PositionRecords) -> tuple[float, float]:
    return float(gain.mean()), cluster_stderr(gain, records.sequence_id)


def _family(directory: Path, family: str) -> dict[str, Any]:
    fit, validation, test = (
        finite_positions(PositionRecords.load(directory / f"{family}.{split}.safetensors"))
        for split in ("fit", "validation", "test")
    )
    designs = _designs(fit)
    thetas = {name: _fit(fit, design(fit)) for name, design in designs.items()}
    kl_one = float(test.kl_at_one.double().mean())
    gap = kl_one - float(test.oracle_kl.double().mean())
    baseline = {
        split: _kl(records, _log_t(designs["band const"](records), thetas["band const"]))
        for split, records in (("validation", validation), ("test", test))
    }
    models = {}
    for name, design in designs.items():
        kl = {
            split: _kl(records, _log_t(design(records), thetas[name]))
            for split, records in (("validation", validation), ("test", test))
        }
        validation_gain = _paired(baseline["validation"] - kl["validation"], validation)
        test_gain = _paired(baseline["test"] - kl["test"], test)
        models[name] = {
            "parameters": thetas[name].tolist(),
            "test_closure": (kl_one - float(kl["test"].mean())) / gap,
            "validation_gain": validation_gain,
            "test_gain": test_gain,
            "kept": name != "band const" and is_significant(*validation_gain),
        }
    return {
        "family": family,
        "positions": {"fit": len(fit), "validation": len(validation), "test": len(test)},
        "test_prompts": int(torch.unique(test.sequence_id).numel()),
        "kl_t1": kl_one,
        "gap": gap,
        "models": models,
    }


def _markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| family | model | test closure | validation gain over band const ± s.e. | kept "
        "| test gain over band const ± s.e. |",
        "|---|---|---:|---:|---|---:|",
    ]
    for result in results:
        for name, model in result["models"].items():
            (vg, vse), (tg, tse) = model["validation_gain"], model["test_gain"]
            lines.append(
                f"| {result['family']} | {name} | {100 * model['test_closure']:+.1f}% "
                f"| {1e3 * vg:+.3f} ± {1e3 * vse:.3f} | {'yes' if model['kept'] else 'no'} "
                f"| {1e3 * tg:+.3f} ± {1e3 * tse:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--families", nargs="+", default=["logit-noise", "int4"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = [_family(args.records, family) for family in args.families]
    table = _markdown(results)
    header = (
        "# Context features vs the band constant\n\nKL gains in 1e-3 nats, pooled over "
        f"T_r; features {', '.join(FEATURES)} (standardised on the fit prompts).\n\n"
    )
    print(header + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_features.md").write_text(header + table, encoding="utf-8")
    (args.out / "context_features.json").write_text(
        json.dumps({"features": FEATURES, "results": results}, indent=2) + "\n",
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
