"""Each layer of a profile's served stack, measured on the same positions: the served model at
T = 1, then the compensation adapter alone, the adapter + the recommended temperature rule, and
the adapter + the bias + its T.

`score_stack` teacher-forces the sequences (sampled as served: with the adapter) through the
clean model and the served model without and with the adapter, and accumulates llama.cpp's
statistics for each layer (`scoring.scoreboard`); every layer's share of KL(T = 1) removed is
paired position by position with the served model at T = 1 (`paired_kld_gain`). Greedy
agreement with the clean model (`scoring.greedy`) is measured per layer on the prompts; the
temperature never moves the argmax, so the adapter + T layer shares the adapter's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from noisy_temp_server.adapter.lora import LoraAdapter
from noisy_temp_server.calibration.adapter_calibration import applied_adapter
from noisy_temp_server.calibration.profile import Profile
from noisy_temp_server.calibration.served_adapter import profile_adapter
from noisy_temp_server.checkpoints.loading import LoadedPair
from noisy_temp_server.correction.files import load_bias_file
from noisy_temp_server.scoring.engine_rows import EngineRows
from noisy_temp_server.scoring.greedy import (
    GreedyAgreement,
    greedy_agreement,
    greedy_continuation,
)
from noisy_temp_server.scoring.sampling import eos_ids
from noisy_temp_server.scoring.scoreboard import (
    PairScoreboard,
    ScoreboardResult,
    corrected_rows,
    paired_kld_gain,
)
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = ["StackLayer", "StackReport", "score_scoreboard", "score_stack"]


@dataclass(frozen=True)
class StackLayer:
    """One layer of the stack: its statistics, its paired gain over the served model at
    T = 1 (`gain` ± `gain_stderr`, KL units; `share` = gain / KL(T = 1)) and its greedy
    agreement (None when not measured)."""

    label: str
    result: ScoreboardResult
    gain: float
    gain_stderr: float
    share: float
    greedy: GreedyAgreement | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "gain": self.gain,
            "gain_stderr": self.gain_stderr,
            "share_removed": self.share,
            "greedy": None if self.greedy is None else vars(self.greedy),
            "statistics": self.result.to_dict(),
        }


@dataclass(frozen=True)
class StackReport:
    layers: tuple[StackLayer, ...]

    def to_markdown(self) -> str:
        lines = [
            "| layer | mean KLD (1e-3) | share of KL(T=1) removed ± s.e. | same top | greedy "
            "tokens before divergence | greedy exact |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for layer in self.layers:
            r, g = layer.result, layer.greedy
            base = r.kld_mean + layer.gain
            share_se = layer.gain_stderr / base if base > 0 else float("nan")
            greedy = (
                ("–", "–")
                if g is None
                else (
                    f"{g.mean_agreed_tokens:.2f} ± {g.agreed_stderr:.2f}",
                    f"{100 * g.exact_match_rate:.1f}%",
                )
            )
            lines.append(
                f"| {layer.label} | {1e3 * r.kld_mean:.2f} ± {1e3 * r.kld_stderr:.2f} "
                f"| {100 * layer.share:.1f}% ± {100 * share_se:.1f}% "
                f"| {100 * r.same_top_rate:.1f}% | {greedy[0]} | {greedy[1]} |"
            )
        return "\n".join(lines) + "\n"


def score_scoreboard(
    pair: LoadedPair,
    sequences: Sequence[ScoringSequence],
    policy: TemperaturePolicy,
    *,
    bias: Tensor | None = None,
    adapter: LoraAdapter | None = None,
    device: str = "cpu",
    engine_rows: EngineRows | None = None,
) -> PairScoreboard:
    """The scoreboard of `pair` teacher-forced on `sequences` (completion positions only);
    `bias`: the vector of the policy's per-token bias (see `PairScoreboard`), `adapter`:
    applied to the served model while scoring (None: none); `engine_rows`: the served rows
    the engine gave for `sequences` (None: the served model's forward)."""
    scorer = PairScorer(
        pair.clean_model,
        pair.served_model if engine_rows is None else engine_rows,
        runtime_noise=pair.runtime_noise,
        device=device,
    )
    board = PairScoreboard(policy, bias=bias)
    with applied_adapter(pair.served_model, adapter):
        for sequence in sequences:
            completion = torch.tensor(
                sequence.token_ids[sequence.prompt_length :], dtype=torch.int64
            )
            for steps, clean, served in scorer.logit_chunks(sequence):
                board.update(
                    clean, served, completion[steps], step=steps, sequence_id=sequence.sequence_id
                )
    return board


class _Greedy:
    """Greedy agreement of the stack's layers on the sequences' prompts, the clean model's
    continuations computed once (None everywhere when `tokens` < 1)."""

    def __init__(self, pair: LoadedPair, sequences: Sequence[ScoringSequence], tokens: int):
        self.pair, self.tokens = pair, tokens
        self.eos_ids = eos_ids(pair.served_model)
        self.prompts = [s.token_ids[: s.prompt_length] for s in sequences]
        self.clean = (
            [
                greedy_continuation(
                    pair.clean_model, p, max_new_tokens=tokens, eos_ids=self.eos_ids
                )
                for p in self.prompts
            ]
            if tokens >= 1
            else []
        )

    def of(self, adapter: LoraAdapter | None, bias: Tensor | None) -> GreedyAgreement | None:
        if self.tokens < 1:
            return None
        with applied_adapter(self.pair.served_model, adapter):
            return greedy_agreement(
                self.pair.clean_model,
                self.pair.served_model,
                self.prompts,
                max_new_tokens=self.tokens,
                eos_ids=self.eos_ids,
                row_correction=None if bias is None else (lambda row: corrected_rows(row, bias)),
                clean_continuations=self.clean,
            )


def score_stack(
    pair: LoadedPair,
    sequences: Sequence[ScoringSequence],
    profile: Profile,
    folder: Path,
    *,
    served_policy: TemperaturePolicy | None = None,
    greedy_tokens: int = 16,
    device: str = "cpu",
) -> StackReport:
    """The stack of `profile` (files beside it in `folder`) on `sequences` (module docstring);
    its top layer is `served_policy` (default: the profile's recommendation) when that serves
    a bias. ValueError when a file the profile names cannot be read."""
    adapter = profile_adapter(profile, folder)
    rule_policy = profile.to_policy(profile.recommended_rule)
    served_policy = profile.to_policy() if served_policy is None else served_policy
    bias = None if served_policy.bias is None else load_bias_file(folder, served_policy.bias)
    base = score_scoreboard(pair, sequences, TemperaturePolicy.identity(), device=device)
    reference = base.accumulators["T=1"]
    name = "adapter" if adapter is not None else "no adapter"
    rule = score_scoreboard(pair, sequences, rule_policy, adapter=adapter, device=device)
    greedy = _Greedy(pair, sequences, greedy_tokens)
    layers_spec: list[tuple[str, PairScoreboard, str, GreedyAgreement | None]] = [
        ("served, T=1", base, "T=1", greedy.of(None, None)),
    ]
    adapter_greedy = layers_spec[0][3] if adapter is None else greedy.of(adapter, None)
    if adapter is not None:
        layers_spec.append(("adapter, T=1", rule, "T=1", adapter_greedy))
    layers_spec.append((f"{name} + T ({rule_policy.rule.value})", rule, "T*", adapter_greedy))
    if bias is not None:
        full = score_scoreboard(
            pair, sequences, served_policy, bias=bias, adapter=adapter, device=device
        )
        layers_spec.append((f"{name} + bias + T", full, "T*", greedy.of(adapter, bias)))
    layers = []
    for label, board, column, agreement in layers_spec:
        accumulator = board.accumulators[column]
        gain, stderr = paired_kld_gain(reference, accumulator)
        result = accumulator.result()
        base_kl = result.kld_mean + gain
        share = gain / base_kl if base_kl > 0 else float("nan")
        layers.append(StackLayer(label, result, gain, stderr, share, agreement))
    return StackReport(tuple(layers))
