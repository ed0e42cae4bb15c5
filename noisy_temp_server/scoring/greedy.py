"""Greedy agreement of a served model with the clean one: a sequence-level measure users read.

Both models continue each prompt greedily (argmax, the served rows corrected as served when a
`row_correction` is given: temperature never moves the argmax, a bias can) for up to
`max_new_tokens` tokens or the end-of-sequence token. For each prompt: the number of tokens
the two continuations share before their first difference, and whether they are identical
(an exact match of the short answer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["GreedyAgreement", "greedy_agreement", "greedy_continuation"]


@dataclass(frozen=True)
class GreedyAgreement:
    """Over `prompts` prompts: `mean_agreed_tokens` (± `agreed_stderr`, over prompts) tokens
    before the first difference, out of at most `max_new_tokens`; `exact_match_rate` the
    share of prompts whose continuations are identical."""

    prompts: int
    max_new_tokens: int
    mean_agreed_tokens: float
    agreed_stderr: float
    exact_match_rate: float

    def describe(self) -> str:
        return (
            f"{self.mean_agreed_tokens:.2f} ± {self.agreed_stderr:.2f} tokens before the first "
            f"difference, {100 * self.exact_match_rate:.1f}% exact ({self.prompts} prompts, "
            f"{self.max_new_tokens} tokens)"
        )


@torch.no_grad()
def greedy_continuation(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    row_correction: Callable[[Tensor], Tensor] | None = None,
) -> list[int]:
    """`model`'s greedy continuation of `prompt_ids` (the end-of-sequence token kept, if
    reached), each step's last logits row passed through `row_correction` first if given."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=device)
    output = model(input_ids=ids, use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        row = output.logits[:, -1, :].float()
        if row_correction is not None:
            row = row_correction(row)
        token = int(row.argmax(dim=-1))
        tokens.append(token)
        if token in eos_ids:
            break
        step = torch.tensor([[token]], dtype=torch.int64, device=device)
        output = model(input_ids=step, past_key_values=output.past_key_values, use_cache=True)
    return tokens


def _agreed(first: list[int], second: list[int]) -> int:
    count = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        count += 1
    return count


def greedy_agreement(
    clean_model: nn.Module,
    served_model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 16,
    eos_ids: set[int] | None = None,
    row_correction: Callable[[Tensor], Tensor] | None = None,
    clean_continuations: Sequence[list[int]] | None = None,
) -> GreedyAgreement:
    """Greedy agreement (module docstring) of `served_model` (its rows through
    `row_correction`) with `clean_model` on `prompts` (token ids); `clean_continuations`:
    the clean model's own, one per prompt, when already computed (`greedy_continuation` with
    the same length and end tokens). ValueError for no prompts, `max_new_tokens` < 1 or a
    count of clean continuations that is not the prompts'."""
    if not prompts or max_new_tokens < 1:
        raise ValueError("greedy agreement needs prompts and max_new_tokens >= 1")
    if clean_continuations is not None and len(clean_continuations) != len(prompts):
        raise ValueError("give one clean continuation per prompt")
    eos = set() if eos_ids is None else eos_ids
    agreed, exact = [], 0
    for index, prompt in enumerate(prompts):
        clean = (
            greedy_continuation(clean_model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos)
            if clean_continuations is None
            else clean_continuations[index]
        )
        served = greedy_continuation(
            served_model,
            prompt,
            max_new_tokens=max_new_tokens,
            eos_ids=eos,
            row_correction=row_correction,
        )
        agreed.append(_agreed(clean, served))
        exact += clean == served
    values = torch.tensor(agreed, dtype=torch.float64)
    stderr = float(values.std()) / math.sqrt(len(agreed)) if len(agreed) > 1 else math.inf
    return GreedyAgreement(
        prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        mean_agreed_tokens=float(values.mean()),
        agreed_stderr=stderr,
        exact_match_rate=exact / len(prompts),
    )
