"""The report: the four experiments of the reference notebook, measured on a clean model.

`write_report(clean_path, out_dir)` writes `report.md` and four PNG figures (matplotlib, Agg):

1. weight-noise scale -> alpha and T* (the measured per-position oracle and the best shared T,
   against sqrt(1 + alpha) and 1 + alpha);
2. layer-group sensitivity (alpha and best T when only one group is perturbed);
3. alpha over generation steps, with its linear trend;
4. mean KL against a temperature sweep, with every rule's (mean) T and the best T marked.

Unlike calibration, the experiments score the same clean-model completions (sampled at T = 1)
under every perturbation, as the notebook does, so differences between perturbations are not
confounded by different texts. The rules marked in experiment 4 are fitted on the same records
(in-sample), for illustration; held-out quality comes from `calibrate`.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib as mpl
import torch

from noisy_temp_server.calibration.curves import best_curve_temperature
from noisy_temp_server.calibration.fitting import FITTED_RULES, fit_rules, rule_temperatures
from noisy_temp_server.calibration.prompts import encode_prompt, load_prompts
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.perturbation import (
    TensorTarget,
    WeightNoiseSpec,
    apply_perturbation,
)
from noisy_temp_server.files import write_atomically
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.sampling import generate_completions
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = ["NoiseSummary", "write_report"]

logger = logging.getLogger(__name__)

DEFAULT_SCALES = (0.002, 0.005, 0.01, 0.02, 0.05)
FOCUS_SCALE = 0.01


@dataclass(frozen=True)
class NoiseSummary:
    """One perturbation: alpha (ratio of means), mean oracle T, best shared T, mean KL(T=1)."""

    label: str
    alpha: float
    oracle_t: float
    best_t: float
    kl_at_one: float


def _summary(label: str, records: PositionRecords) -> NoiseSummary:
    return NoiseSummary(
        label=label,
        alpha=float(records.sigma2.double().mean() / records.tau2.double().mean()),
        oracle_t=float(records.oracle_t.double().mean()),
        best_t=best_curve_temperature(
            records.kl_curve, records.curve_temperatures, TemperatureBounds()
        ),
        kl_at_one=float(records.kl_at_one.double().mean()),
    )


@dataclass(frozen=True)
class _Experiments:
    """The records the report is made of: one per scale, per layer group, and the focus scale."""

    prompts: int
    by_scale: dict[float, PositionRecords]
    groups: dict[str, PositionRecords]
    focus: PositionRecords


def _layer_targets(layers: int) -> dict[str, TensorTarget]:
    thirds = (0, layers // 3, 2 * layers // 3, layers)
    targets = {
        "all (attention + mlp)": TensorTarget(),
        "attention": TensorTarget(groups=("attention",)),
        "mlp": TensorTarget(groups=("mlp",)),
        "lm_head": TensorTarget(groups=("lm_head",)),
    }
    for name, first, stop in zip(("early", "middle", "late"), thirds, thirds[1:], strict=False):
        if first < stop:
            targets[f"{name} ({first}-{stop - 1})"] = TensorTarget(layers=(first, stop))
    return targets


def _run_experiments(
    clean_path: Path,
    *,
    device: str,
    prompts: int,
    max_new_tokens: int,
    scales: tuple[float, ...],
    seed: int,
) -> _Experiments:
    """Clean-model completions, scored under every perturbation of the report."""
    clean, tokenizer = load_causal_lm(clean_path, device=device)
    prompt_ids = [encode_prompt(tokenizer, p) for p in load_prompts()[:prompts]]
    sequences = generate_completions(
        clean, tokenizer, prompt_ids, max_new_tokens=max_new_tokens, seed=seed
    )
    started = time.monotonic()

    def score(spec: WeightNoiseSpec) -> PositionRecords:
        served = copy.deepcopy(clean)
        apply_perturbation(served, spec)
        records = PairScorer(clean, served, device=device).score(sequences)
        logger.info("report: %s scored (%.0f s)", spec.label, time.monotonic() - started)
        return records

    by_scale = {scale: score(WeightNoiseSpec(scale=scale, seed=seed)) for scale in scales}
    focus = by_scale.get(FOCUS_SCALE) or score(WeightNoiseSpec(scale=FOCUS_SCALE, seed=seed))
    groups = {
        name: score(WeightNoiseSpec(scale=FOCUS_SCALE, seed=seed, target=target))
        for name, target in _layer_targets(int(clean.config.num_hidden_layers)).items()
    }
    return _Experiments(len(sequences), by_scale, groups, focus)


def _plot_scales(plt: Any, scale_rows: list[NoiseSummary], figures: Path) -> None:
    """Figure 1: weight-noise scale -> alpha and T*."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xs = [float(r.label) for r in scale_rows]
    axes[0].plot(xs, [r.alpha for r in scale_rows], "bo-")
    axes[0].set(xlabel="weight noise scale", ylabel="alpha = sigma2 / tau2", xscale="log")
    axes[1].plot(xs, [r.oracle_t for r in scale_rows], "ro-", label="mean per-position oracle")
    axes[1].plot(xs, [r.best_t for r in scale_rows], "gs-", label="best shared T")
    axes[1].set(xlabel="weight noise scale", ylabel="T*", xscale="log")
    axes[1].legend()
    for axis in axes[:2]:  # label the measured scales, not the log axis' crowded minor ticks
        axis.set_xticks(xs, [f"{x:g}" for x in xs])
        axis.xaxis.set_minor_formatter(mpl.ticker.NullFormatter())
    alpha_line = torch.linspace(0, max(r.alpha for r in scale_rows) * 1.1, 100)
    axes[2].plot(alpha_line, torch.sqrt(1 + alpha_line), "b-", label="sqrt(1 + alpha)")
    axes[2].plot(alpha_line, 1 + alpha_line, "m--", label="1 + alpha")
    axes[2].scatter(
        [r.alpha for r in scale_rows],
        [r.oracle_t for r in scale_rows],
        c="red",
        label="oracle (mean)",
        zorder=5,
    )
    axes[2].scatter(
        [r.alpha for r in scale_rows],
        [r.best_t for r in scale_rows],
        c="green",
        marker="s",
        label="best shared T",
        zorder=5,
    )
    axes[2].set(xlabel="alpha", ylabel="T*")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(figures / "weight_noise_t_star.png", dpi=120)
    plt.close(fig)


def _plot_groups(plt: Any, group_rows: list[NoiseSummary], figures: Path) -> None:
    """Figure 2: layer-group sensitivity."""
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.barh([r.label for r in group_rows], [r.alpha for r in group_rows])
    for i, r in enumerate(group_rows):
        ax.annotate(
            f"best T={r.best_t:.2f}",
            xy=(r.alpha, i),
            xytext=(5, 0),
            textcoords="offset points",
            va="center",
        )
    ax.set(xlabel="alpha", title=f"layer sensitivity (weight noise {FOCUS_SCALE:g})")
    fig.tight_layout()
    fig.savefig(figures / "layer_sensitivity.png", dpi=120)
    plt.close(fig)


def _plot_steps(plt: Any, focus: PositionRecords, figures: Path) -> tuple[float, float]:
    """Figure 3: alpha over generation steps; returns its linear trend (slope, intercept)."""
    steps = torch.unique(focus.step)
    alpha_by_step = torch.stack(
        [
            focus.sigma2[focus.step == s].double().mean()
            / focus.tau2[focus.step == s].double().mean()
            for s in steps
        ]
    )
    design = torch.stack([steps.double(), torch.ones(len(steps), dtype=torch.float64)], dim=1)
    slope, intercept = torch.linalg.lstsq(design, alpha_by_step[:, None]).solution[:, 0].tolist()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(steps, alpha_by_step, "bo-", label="alpha (ratio of means over prompts)")
    ax.plot(steps, slope * steps.double() + intercept, "r--", label=f"trend (slope {slope:.2e})")
    ax.set(xlabel="generation step", ylabel="alpha")
    ax.legend()
    fig.tight_layout()
    fig.savefig(figures / "noise_evolution.png", dpi=120)
    plt.close(fig)
    return slope, intercept


def _plot_sweep(
    plt: Any, focus: PositionRecords, figures: Path, *, prompts: int, seed: int
) -> tuple[float, dict[str, float]]:
    """Figure 4: mean KL against T, every rule's mean T marked; returns (best T, rule -> T)."""
    settings = CalibrationSettings(prompts=max(prompts, 2), seed=seed, min_cell_positions=20)
    parameters, _ = fit_rules(focus, settings)
    rule_t = {
        rule.value: float(rule_temperatures(parameters.to_policy(rule), focus).double().mean())
        for rule in FITTED_RULES
    }
    mean_curve = focus.kl_curve.double().mean(dim=0)
    best_t = best_curve_temperature(focus.kl_curve, focus.curve_temperatures, TemperatureBounds())
    fig, ax = plt.subplots(figsize=(9, 5))
    shown = (focus.curve_temperatures >= 0.5) & (focus.curve_temperatures <= 2.5)
    ax.plot(focus.curve_temperatures[shown], mean_curve[shown], "b-", label="mean KL")
    for (name, t), colour in zip(rule_t.items(), [f"C{i}" for i in range(10)], strict=False):
        ax.axvline(t, color=colour, linestyle="--", label=f"{name}: T={t:.3f}")
    ax.axvline(best_t, color="black", linestyle=":", label=f"best T={best_t:.3f}")
    ax.set(
        xlabel="temperature",
        ylabel="KL(p || q_T)",
        xscale="log",
        title=f"KL vs temperature (weight noise {FOCUS_SCALE:g})",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(figures / "temperature_optimization.png", dpi=120)
    plt.close(fig)
    return best_t, rule_t


def _table(rows: list[NoiseSummary], first: str) -> str:
    lines = [
        f"| {first} | alpha | mean oracle T | best shared T | sqrt(1+alpha) | 1+alpha "
        "| mean KL(T=1) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.label} | {r.alpha:.4f} | {r.oracle_t:.3f} | {r.best_t:.3f} | "
        f"{(1 + r.alpha) ** 0.5:.3f} | {1 + r.alpha:.3f} | {r.kl_at_one:.4f} |"
        for r in rows
    ]
    return "\n".join(lines)


def write_report(
    clean_path: Path,
    out_dir: Path,
    *,
    device: str = "cpu",
    prompts: int = 8,
    max_new_tokens: int = 24,
    scales: tuple[float, ...] = DEFAULT_SCALES,
    seed: int = 0,
) -> Path:
    """Run the four experiments on the checkpoint `clean_path`; returns the markdown's path.

    Costs one teacher-forced scoring of `prompts` x `max_new_tokens` positions per perturbation
    (len(scales) + 7 perturbations). Progress is logged.
    """
    mpl.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    experiments = _run_experiments(
        clean_path,
        device=device,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        scales=scales,
        seed=seed,
    )
    scale_rows = [_summary(f"{s:g}", r) for s, r in experiments.by_scale.items()]
    group_rows = [_summary(name, r) for name, r in experiments.groups.items()]
    _plot_scales(plt, scale_rows, out_dir)
    _plot_groups(plt, group_rows, out_dir)
    slope, intercept = _plot_steps(plt, experiments.focus, out_dir)
    best_t, rule_t = _plot_sweep(plt, experiments.focus, out_dir, prompts=prompts, seed=seed)
    positions = len(experiments.focus)
    markdown = f"""# Temperature under weight noise: {clean_path.resolve().name}

{experiments.prompts} prompts, clean-model completions of up to {max_new_tokens} tokens
({positions} scored positions per perturbation); gaussian weight noise, scale relative to each
tensor's std, seed {seed}. Regenerate with
`noisy-temp-server calibrate --report {out_dir}`.

## 1. Weight noise -> alpha -> T*

{_table(scale_rows, "scale")}

![weight noise](weight_noise_t_star.png)

## 2. Layer-group sensitivity (scale {FOCUS_SCALE:g})

{_table(group_rows, "group")}

![layer sensitivity](layer_sensitivity.png)

## 3. alpha over generation steps (scale {FOCUS_SCALE:g})

Linear trend: slope {slope:.3e} per step, intercept {intercept:.4f}.

![noise evolution](noise_evolution.png)

## 4. KL against temperature (scale {FOCUS_SCALE:g})

Best shared T {best_t:.3f}. Mean T of each rule (fitted in-sample on these positions):
{", ".join(f"{k} {v:.3f}" for k, v in rule_t.items())}.

![temperature optimisation](temperature_optimization.png)
"""
    path = out_dir / "report.md"
    write_atomically(path, markdown.encode())
    logger.info("report written to %s (%.0f s)", path, time.monotonic() - started)
    return path
