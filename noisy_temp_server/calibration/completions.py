"""Completions of calibration prompts, sampled from a pair's served model as it serves."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from noisy_temp_server.calibration.prompts import Prompt, encode_prompt
from noisy_temp_server.checkpoints.loading import LoadedPair
from noisy_temp_server.scoring.sampling import generate_completions
from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = ["sample_completions"]


def sample_completions(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[ScoringSequence]:
    """One completion per prompt, sampled from the pair's served model at T = 1 as it serves
    (with its runtime logit noise, if any): the text every offline score is computed on."""
    return generate_completions(
        pair.served_model,
        pair.tokenizer,
        [encode_prompt(pair.tokenizer, prompt) for prompt in prompts],
        max_new_tokens=max_new_tokens,
        seed=seed,
        runtime_noise=pair.runtime_noise,
        progress=progress,
    )
