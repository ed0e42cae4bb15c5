"""Greedy agreement of a served model with the clean one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.scoring.greedy import greedy_agreement, greedy_continuation


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_causal_lm(tiny_model_dir)[0]


PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 12, 4, 4, 60]]


def test_a_model_agrees_with_itself_on_every_token(model: torch.nn.Module) -> None:
    agreement = greedy_agreement(model, model, PROMPTS, max_new_tokens=6)
    assert agreement.exact_match_rate == 1.0
    assert agreement.mean_agreed_tokens == 6.0


def test_the_continuation_is_the_argmax_of_the_full_forward(model: torch.nn.Module) -> None:
    tokens = greedy_continuation(model, PROMPTS[0], max_new_tokens=5, eos_ids=set())
    ids = torch.tensor([PROMPTS[0] + tokens[:-1]])
    with torch.no_grad():
        argmax = model(input_ids=ids).logits[0, len(PROMPTS[0]) - 1 :].argmax(-1).tolist()
    assert tokens == argmax


def test_a_row_correction_that_forces_another_token_diverges_at_once(
    model: torch.nn.Module,
) -> None:
    first = [greedy_continuation(model, p, max_new_tokens=1, eos_ids=set())[0] for p in PROMPTS]
    forced = next(t for t in range(3, 500) if t not in first)

    def force(row: torch.Tensor) -> torch.Tensor:
        row = row.clone()
        row[:, forced] += 1e4
        return row

    agreement = greedy_agreement(model, model, PROMPTS, max_new_tokens=4, row_correction=force)
    assert agreement.mean_agreed_tokens == 0.0
    assert agreement.exact_match_rate == 0.0


def test_an_end_of_sequence_token_ends_the_continuation(model: torch.nn.Module) -> None:
    first = greedy_continuation(model, PROMPTS[1], max_new_tokens=3, eos_ids=set())
    assert greedy_continuation(model, PROMPTS[1], max_new_tokens=3, eos_ids={first[0]}) == first[:1]
