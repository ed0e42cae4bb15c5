"""Completions of calibration prompts, sampled from a pair's served model as it serves."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Literal

from noisy_temp_server.calibration.prompts import Prompt, encode_prompt
from noisy_temp_server.checkpoints.loading import LoadedPair
from noisy_temp_server.checkpoints.quantized_formats import quantizes_activations_to_int
from noisy_temp_server.scoring.engine_rows import EngineCompletion, EngineRows, sample_with_engine
from noisy_temp_server.scoring.sampling import eos_ids, generate_completions
from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = [
    "ServedRows",
    "sample_completions",
    "sample_engine_completions",
    "sample_served",
    "served_rows_for",
]

logger = logging.getLogger(__name__)

ServedRows = Literal["auto", "model", "engine"]
"""Where the served rows come from: the served model's forward (``model``), the engine's rows
(``engine``, `sample_engine_completions`), or ``auto`` (`served_rows_for`)."""


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


def sample_engine_completions(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[EngineCompletion]:
    """One completion per prompt sampled at T = 1 by vLLM's engine serving the pair's served
    folder, with the rows it sampled them from (`scoring.engine_rows.sample_with_engine`),
    stopping at the served model's end-of-sequence tokens. ValueError for a pair without a
    served folder or with runtime logit noise (the engine would serve neither)."""
    if pair.served_path is None or pair.runtime_noise is not None:
        raise ValueError(
            "the engine's rows need a served model folder; this pair's served model is made in "
            "memory (--spec): score it with served_rows model"
        )
    return sample_with_engine(
        pair.served_path,
        [encode_prompt(pair.tokenizer, prompt) for prompt in prompts],
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop_token_ids=eos_ids(pair.served_model),
        progress=progress,
    )


def served_rows_for(
    pair: LoadedPair, choice: ServedRows, *, with_adapter: bool
) -> Literal["model", "engine"]:
    """`choice` with ``auto`` resolved: ``engine`` for a served folder whose activations are
    quantized to integers (`quantizes_activations_to_int`: transformers' forward is not what
    vLLM serves) when no adapter is fitted or served (the engine's rows have none; a warning
    then says that transformers' forward is scored), else ``model``."""
    if choice != "auto":
        return choice
    folder = pair.served_path
    if folder is None or not quantizes_activations_to_int(folder):
        return "model"
    if with_adapter:
        logger.warning(
            "%s quantizes its activations to integers, which transformers' forward does not do "
            "as vLLM's kernels do; with an adapter it is scored with transformers' forward all "
            "the same (the engine's rows have no adapter)",
            folder,
        )
        return "model"
    return "engine"


def sample_served(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    served_rows: Literal["model", "engine"],
    *,
    max_new_tokens: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[ScoringSequence], EngineRows | None]:
    """The completions the pair's served model samples as served: by the engine, with its rows
    of them, where `served_rows` is ``engine`` (`sample_engine_completions`); else by the
    served model in this process (`sample_completions`), with no rows."""
    if served_rows == "engine":
        completions = sample_engine_completions(
            pair, prompts, max_new_tokens=max_new_tokens, seed=seed, progress=progress
        )
        return [c.sequence for c in completions], EngineRows(completions)
    sequences = sample_completions(
        pair, prompts, max_new_tokens=max_new_tokens, seed=seed, progress=progress
    )
    return sequences, None
