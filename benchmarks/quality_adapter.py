"""The compensation adapter's part of `benchmarks/quality.py` (`--adapter-rank R`).

Per family, calibration runs with the adapter (`calibration.pipeline.calibrate_with_data`:
the adapter fitted and gated first, every later stage on rows served with it where it is
recommended); a pair serving the clean weights (runtime logit noise) is refused by
calibration and calibrated without one, and the refusal is reported. Then, on the test
prompts (and the cross-domain prompts when given), each layer of the stack
(`calibration.stack.score_stack`: served T = 1, adapter alone, adapter + T, adapter + bias
+ T) beside the per-position oracle T without and with the adapter, and whether the served
stack is never significantly worse than T = 1.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from noisy_temp_server.adapter.lora import LoraAdapter, save_peft_adapter
from noisy_temp_server.calibration.adapter_calibration import applied_adapter
from noisy_temp_server.calibration.completions import sample_completions
from noisy_temp_server.calibration.curves import best_curve_temperature
from noisy_temp_server.calibration.pipeline import (
    CalibrationData,
    calibrate_with_data,
)
from noisy_temp_server.calibration.profile import Profile
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.served_adapter import profile_adapter
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    is_not_worse,
)
from noisy_temp_server.calibration.stack import StackReport, score_stack
from noisy_temp_server.checkpoints.loading import LoadedPair
from noisy_temp_server.correction.files import save_bias_file
from noisy_temp_server.scoring.records import interpolate_kl
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = ["AdapterFamily", "calibrate_family", "stack_section"]


@dataclass(frozen=True)
class AdapterFamily:
    """One family calibrated with the adapter asked for: the calibration and its data, and
    calibration's refusal (one line) where the pair has no weight error to correct."""

    data: CalibrationData
    refusal: str | None


def calibrate_family(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    *,
    device: str = "cpu",
) -> AdapterFamily:
    """Calibration of `pair` with `settings.adapter_rank`; where calibration refuses the
    adapter (a pair serving the clean weights), calibration without one (every adapter option
    at its default) and the refusal."""
    try:
        return AdapterFamily(calibrate_with_data(pair, prompts, settings, device=device), None)
    except ValueError as refusal:
        if pair.served_model is not pair.clean_model:
            raise
        no_adapter = {
            name: field.default
            for name, field in CalibrationSettings.model_fields.items()
            if name.startswith("adapter_")
        }
        plain = CalibrationSettings.model_validate(settings.model_dump() | no_adapter)
        data = calibrate_with_data(pair, prompts, plain, device=device)
        return AdapterFamily(data, str(refusal))


def _save_beside(folder: Path, data: CalibrationData) -> Path:
    """The profile and the files it names in `folder`, as `calibrate` saves them; its path."""
    result = data.result
    if result.bias is not None:
        save_bias_file(folder, result.bias.correction.bias)
    if result.adapter is not None:
        save_peft_adapter(folder, result.adapter.adapter)
    path = folder / "profile.json"
    result.profile.save(path)
    return path


def _test_sequences(
    sequences: Sequence[ScoringSequence], data: CalibrationData
) -> list[ScoringSequence]:
    test_ids = set(torch.unique(data.result.test.sequence_id).tolist())
    return [s for s in sequences if s.sequence_id in test_ids]


def _oracle_shares(
    pair: LoadedPair,
    sequences: Sequence[ScoringSequence],
    adapter: LoraAdapter | None,
    device: str,
    bounds: TemperatureBounds,
) -> dict[str, float]:
    """Share of KL(served, T = 1) the per-position oracle T removes, without and with the
    adapter, on the same positions; and, without the adapter, the best constant T's (the one T
    in `bounds` minimising the mean KL of these very positions: hindsight, an upper bound for
    any constant), keyed with its T."""
    scorer = PairScorer(
        pair.clean_model, pair.served_model, runtime_noise=pair.runtime_noise, device=device
    )
    plain = scorer.score(sequences)
    with applied_adapter(pair.served_model, adapter):
        adapted = scorer.score(sequences)
    finite = torch.isfinite(plain.kl_at_one) & torch.isfinite(adapted.oracle_kl)
    kl_one = float(plain.kl_at_one[finite].double().mean())

    def share(kl: torch.Tensor) -> float:
        return 1 - float(kl[finite].double().mean()) / kl_one if kl_one > 0 else float("nan")

    shares = {"oracle T": share(plain.oracle_kl)}
    curves = plain.kl_curve[finite]
    if curves.shape[0]:
        best = best_curve_temperature(curves, plain.curve_temperatures, bounds)
        constant = torch.full((curves.shape[0],), best)
        kl = torch.zeros_like(plain.kl_at_one)
        kl[finite] = interpolate_kl(curves, plain.curve_temperatures, constant).to(kl.dtype)
        shares[f"best constant T = {best:.3f} in hindsight"] = share(kl)
    if adapter is not None:
        shares["adapter + oracle T"] = share(adapted.oracle_kl)
    return shares


def _stack_document(stack: StackReport, oracle: dict[str, float]) -> dict[str, Any]:
    top = stack.layers[-1]
    return {
        "layers": [layer.to_dict() for layer in stack.layers],
        "oracle_share_removed": oracle,
        "served": top.label,
        "served_not_worse_than_t1": is_not_worse(top.gain, top.gain_stderr),
    }


def _stack_text(title: str, stack: StackReport, document: dict[str, Any]) -> str:
    oracle = ", ".join(
        f"{name} {100 * v:+.1f}%" for name, v in document["oracle_share_removed"].items()
    )
    verdict = "ok" if document["served_not_worse_than_t1"] else "WORSE"
    return (
        f"**{title}** (share of KL(T=1) removed by the per-position oracle and the best "
        f"constant T on the same positions: {oracle}); served stack ({document['served']}) "
        f"never significantly worse than T = 1: {verdict}\n\n{stack.to_markdown()}"
    )


def _adapter_line(family: AdapterFamily) -> str:
    if family.refusal is not None:
        return f"adapter: not applicable, calibration refuses it: {family.refusal}"
    summary = family.data.result.profile.adapter
    assert summary is not None
    test = summary.test
    share = test.gain / (test.mean_kl + test.gain) if test.mean_kl + test.gain > 0 else 0.0
    ridge = "" if summary.ridge is None else f", ridge {summary.ridge:g}"
    completions = family.data.result.profile.settings.adapter_fit_completions
    refit = "" if completions == 1 else f", refitted on {completions} completions per prompt"
    distilled = "" if summary.distillation is None else f", {summary.distillation.describe()}"
    return (
        f"adapter: rank {summary.rank} {summary.method}{ridge}{refit}{distilled}, "
        f"{summary.layers} layers, "
        f"{'recommended' if summary.recommended else 'NOT recommended'} (gate half: gain over "
        f"T = 1 {1e3 * summary.validation.gain:+.3f} ± {1e3 * summary.validation.gain_stderr:.3f}"
        f" e-3); alone on test at T = 1: {100 * share:+.1f}% of KL(T=1)"
    )


def stack_section(
    pair: LoadedPair,
    family: AdapterFamily,
    cross_domain: Sequence[Prompt] = (),
    *,
    greedy_tokens: int = 16,
    device: str = "cpu",
) -> tuple[str, dict[str, Any]]:
    """Markdown and JSON of the stack of `family`'s profile on its test prompts and, if
    given, on the `cross_domain` prompts (sampled as served, with the adapter)."""
    data = family.data
    settings = data.result.profile.settings
    document: dict[str, Any] = {
        "adapter": None
        if data.result.profile.adapter is None
        else data.result.profile.adapter.model_dump(mode="json"),
        "refusal": family.refusal,
    }
    texts = [_adapter_line(family)]
    with tempfile.TemporaryDirectory() as folder:
        profile = Profile.load(_save_beside(Path(folder), data))
        adapter = profile_adapter(profile, Path(folder))
        sets = [("test prompts", _test_sequences(data.sequences, data))]
        if cross_domain:
            with applied_adapter(pair.served_model, adapter):  # sampled as served
                formal = sample_completions(
                    pair, cross_domain, max_new_tokens=settings.max_new_tokens, seed=settings.seed
                )
            sets.append(("cross-domain prompts", formal))
        for title, sequences in sets:
            stack = score_stack(
                pair, sequences, profile, Path(folder), greedy_tokens=greedy_tokens, device=device
            )
            oracle = _oracle_shares(pair, sequences, adapter, device, settings.bounds)
            part = _stack_document(stack, oracle)
            texts.append(_stack_text(f"{title} ({len(sequences)})", stack, part))
            document[title.replace(" ", "_")] = part
    return "\n\n".join(texts) + "\n", document
