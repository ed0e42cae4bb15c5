"""The compensation adapter's part of `benchmarks/quality.py` (`--adapter-rank R`).

Per family, calibration runs with the adapter (`calibration.pipeline.calibrate_with_data`:
the adapter fitted and gated first, every later stage on rows served with it where it is
recommended); a pair serving the clean weights (runtime logit noise) is refused by
calibration and calibrated without one, and the refusal is reported. Then, on the test
prompts (and the cross-domain prompts when given), each layer of the stack
(`calibration.stack.score_stack`: served T = 1, adapter alone, adapter + T, adapter + bias
+ T) beside the per-position oracle T without and with the adapter, and whether the served
stack is never significantly worse than T = 1. `head_map_gain` measures a head map fitted
on top of the adapter against the bias + T alone, paired on the test rows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from noisy_temp_server.calibration.adapter_calibration import applied_adapter
from noisy_temp_server.calibration.bias_fit import calibrate_bias
from noisy_temp_server.calibration.pipeline import (
    CalibrationData,
    calibrate_with_data,
    sample_completions,
)
from noisy_temp_server.calibration.profile import CalibrationSettings, Profile
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.significance import (
    is_not_worse,
    is_significant,
    split_fit_validation_test,
)
from noisy_temp_server.calibration.stack import StackReport, profile_adapter, score_stack
from noisy_temp_server.correction.adapter import LoraAdapter, save_peft_adapter
from noisy_temp_server.correction.bias import evaluate_bias
from noisy_temp_server.correction.files import save_bias_file, save_head_map_file
from noisy_temp_server.pairs.loading import LoadedPair
from noisy_temp_server.pairs.scorer import PairScorer, ScoringSequence
from noisy_temp_server.pairs.standard_error import cluster_stderr

__all__ = ["AdapterFamily", "calibrate_family", "head_map_gain", "stack_section"]


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
    adapter (a pair serving the clean weights), calibration without one and the refusal."""
    try:
        return AdapterFamily(calibrate_with_data(pair, prompts, settings, device=device), None)
    except ValueError as refusal:
        if pair.served_model is not pair.clean_model:
            raise
        plain = settings.model_copy(update={"adapter_rank": 0})
        data = calibrate_with_data(pair, prompts, plain, device=device)
        return AdapterFamily(data, str(refusal))


def _save_beside(folder: Path, data: CalibrationData) -> Path:
    """The profile and the files it names in `folder`, as `calibrate` saves them; its path."""
    result = data.result
    if result.bias is not None:
        save_bias_file(folder, result.bias.correction.bias)
        if result.bias.head_map is not None:
            save_head_map_file(folder, result.bias.head_map.head_map)
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
) -> dict[str, float]:
    """Share of KL(served, T = 1) the per-position oracle T removes, without and with the
    adapter, on the same positions."""
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
        f"**{title}** (share of KL(T=1) removed by the per-position oracle on the same "
        f"positions: {oracle}); served stack ({document['served']}) never significantly worse "
        f"than T = 1: {verdict}\n\n{stack.to_markdown()}"
    )


def _adapter_line(family: AdapterFamily) -> str:
    if family.refusal is not None:
        return f"adapter: not applicable, calibration refuses it: {family.refusal}"
    summary = family.data.result.profile.adapter
    assert summary is not None
    test = summary.test
    share = test.gain / (test.mean_kl + test.gain) if test.mean_kl + test.gain > 0 else 0.0
    ridge = "" if summary.ridge is None else f", ridge {summary.ridge:g}"
    return (
        f"adapter: rank {summary.rank} {summary.method}{ridge}, {summary.layers} layers, "
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
            oracle = _oracle_shares(pair, sequences, adapter, device)
            part = _stack_document(stack, oracle)
            texts.append(_stack_text(f"{title} ({len(sequences)})", stack, part))
            document[title.replace(" ", "_")] = part
    return "\n\n".join(texts) + "\n", document


def head_map_gain(pair: LoadedPair, data: CalibrationData, rank: int) -> tuple[str, dict[str, Any]]:
    """A rank-`rank` head map fitted on top of what calibration served (the adapter where
    recommended), as `calibrate --head-map-rank` fits it, against the bias + T without it:
    the paired gain KL(bias + T) - KL(map + bias + T) on the test rows at T_r = 1, ± its
    prompt-clustered s.e. (both fitted and measured on the same rows)."""
    result, scored = data.result, data.scored
    settings = result.profile.settings
    assert result.bias is not None  # calibration keeps rows
    mapped = calibrate_bias(
        scored.rows,
        settings,
        pair.head_basis(scored.rows.vocab_size),
        rule=result.profile.to_policy(result.profile.recommended_rule),
        row_records=scored.row_records,
        head_map_rank=rank,
    )
    assert mapped.head_map is not None
    test = split_fit_validation_test(
        scored.rows.sequence_id.cpu(),
        settings.validation_fraction,
        settings.test_fraction,
        settings.seed,
    )[2]
    rows = scored.rows.select(test)
    kl_bias = evaluate_bias(rows, result.bias.correction).kl.double().cpu()
    kl_map = evaluate_bias(mapped.head_map.head_map.mapped(rows), mapped.correction).kl
    gain = kl_bias - kl_map.double().cpu()
    mean, stderr = float(gain.mean()), cluster_stderr(gain, rows.sequence_id.cpu())
    kl_one = mapped.test.t_one.mean_kl
    document = {
        "rank": rank,
        "penalty": mapped.head_map.penalty,
        "positions": len(rows),
        "kl_t1": kl_one,
        "bias_share_removed": result.bias.test.share_removed,
        "map_bias_share_removed": mapped.test.share_removed,
        "gain": mean,
        "gain_stderr": stderr,
        "significant": is_significant(mean, stderr),
        "map_recommended": mapped.recommended,
    }
    share = 100 * mean / kl_one if kl_one > 0 else float("nan")
    text = (
        f"head map rank {rank} (penalty {mapped.head_map.penalty:.1e}) on top of what "
        f"calibration served (the adapter where recommended), test rows ({len(rows)}), shares "
        f"of KL at T = 1 of the rows as served: bias + T removes "
        f"{100 * document['bias_share_removed']:.1f}%, map + bias + T "
        f"{100 * document['map_bias_share_removed']:.1f}%; paired gain of the map "
        f"{1e3 * mean:+.3f} ± {1e3 * stderr:.3f} e-3 ({share:+.1f}% of KL(T=1)): "
        f"{'significant' if document['significant'] else 'not significant'}"
    )
    return text + "\n", document
