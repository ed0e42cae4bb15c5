"""Sampling completions from the served model with transformers, as it would serve them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

from noisy_temp_server.checkpoints.perturbation import (
    RuntimeLogitNoiseSpec,
    add_runtime_logit_noise,
)
from noisy_temp_server.scoring.sequence import ScoringSequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["eos_ids", "generate_completions"]


class _RuntimeNoise(LogitsProcessor):
    """transformers logits processor adding the pair's runtime logit noise while generating."""

    def __init__(self, sigma: float, generator: torch.Generator) -> None:
        self.sigma = sigma
        self.generator = generator

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        return add_runtime_logit_noise(scores, self.sigma, self.generator)


def eos_ids(model: PreTrainedModel) -> set[int]:
    """The token ids that end a generation of `model` (its generation config's, as a set)."""
    eos_ids = model.generation_config.eos_token_id
    return set(eos_ids if isinstance(eos_ids, list) else [] if eos_ids is None else [eos_ids])


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[list[int]],
    *,
    max_new_tokens: int,
    seed: int,
    runtime_noise: RuntimeLogitNoiseSpec | None = None,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[ScoringSequence]:
    """Sample one completion per prompt (token ids, e.g. from
    `noisy_temp_server.calibration.prompts.encode_prompt`) from `model` at T = 1 (no
    top-k/top-p), as served.

    Sequence ids are the prompts' indices. A completion stops after the end-of-sequence token
    (which it keeps) or at `max_new_tokens`. Sampling is deterministic in `seed` and leaves the
    global RNG state as it was. `progress(done, total)` is called after each batch.
    """
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    eos = eos_ids(model)
    device = next(model.parameters()).device
    sequences: list[ScoringSequence] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for first in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[first : first + batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            torch.manual_seed(seed * 1_000_003 + first)
            processors = LogitsProcessorList()
            if runtime_noise is not None and runtime_noise.sigma > 0:
                generator = torch.Generator(device=device).manual_seed(
                    runtime_noise.seed * 1_000_003 + first
                )
                processors.append(_RuntimeNoise(runtime_noise.sigma, generator))
            output = model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                logits_processor=processors,
            )
            for offset, ids in enumerate(batch):
                completion: list[int] = []
                for token in output[offset, width:].tolist():
                    completion.append(int(token))
                    if token in eos:
                        break
                sequences.append(ScoringSequence(ids + completion, len(ids), first + offset))
            if progress is not None:
                progress(min(first + batch_size, len(prompt_ids)), len(prompt_ids))
    return sequences
