"""Distilling a compensation adapter on the clean model's next-token distributions.

`distil_adapter` starts from a fitted adapter (`adapter.layer_fit.fit_compensation_adapter`:
training-free, one layer at a time) and trains all its factors together, end to end, by Adam
on the measure calibration reports: KL(clean || served + adapter) at T = 1, averaged over the
completion positions of its training sequences. After each epoch it measures the same KL on
held-out sequences and keeps the best adapter seen, the start included: it never returns one
worse on those sequences than the one it was given.

Memory: both models' weights (never written; the served model's parameters are frozen for the
duration and restored after), the adapter's factors with their gradients and Adam's two
moments (four copies of the adapter), and one sequence's activations and vocabulary rows.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from noisy_temp_server.adapter.layer_fit import applied_deltas
from noisy_temp_server.adapter.lora import LoraAdapter, LowRankDelta
from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = ["Distillation", "distil_adapter"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Distillation:
    """The kept adapter, the epoch it comes from (0: the adapter given) and the held-out mean
    KL after each epoch (index 0: before the first)."""

    adapter: LoraAdapter
    best_epoch: int
    held_out_kl: tuple[float, ...]


def _completion_kl(clean: nn.Module, served: nn.Module, sequence: ScoringSequence) -> Tensor:
    """KL(clean || served) at T = 1 at each completion position of `sequence` ([n] float32,
    differentiable in the served model's trainable tensors)."""
    device = next(served.parameters()).device
    ids = torch.tensor([list(sequence.token_ids)], dtype=torch.int64, device=device)
    rows = slice(sequence.prompt_length - 1, -1)  # the rows that predict the completion
    with torch.no_grad():
        target = torch.log_softmax(clean(input_ids=ids).logits[0, rows].float(), dim=-1)
    served_rows = torch.log_softmax(served(input_ids=ids).logits[0, rows].float(), dim=-1)
    return (target.exp() * (target - served_rows)).sum(dim=-1)


def _held_out_kl(
    clean: nn.Module,
    served: nn.Module,
    deltas: dict[str, LowRankDelta],
    sequences: Sequence[ScoringSequence],
) -> float:
    with torch.no_grad(), applied_deltas(served, deltas):
        kls = torch.cat([_completion_kl(clean, served, s) for s in sequences])
    return float(kls[torch.isfinite(kls)].double().mean())


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for parameter, _ in flags:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


def _detached(deltas: dict[str, LowRankDelta], like: LoraAdapter) -> LoraAdapter:
    """A copy of `deltas` on the CPU, as an adapter of `like`'s rank and base model."""
    layers = {
        name: LowRankDelta(down=d.down.detach().cpu().clone(), up=d.up.detach().cpu().clone())
        for name, d in deltas.items()
    }
    return LoraAdapter(layers=layers, rank=like.rank, base_model=like.base_model)


def distil_adapter(
    clean_model: nn.Module,
    served_model: nn.Module,
    adapter: LoraAdapter,
    train: Sequence[ScoringSequence],
    held_out: Sequence[ScoringSequence],
    *,
    epochs: int,
    learning_rate: float,
    sequences_per_step: int = 4,
    seed: int = 0,
) -> Distillation:
    """`adapter` trained for up to `epochs` passes over `train` (shuffled with `seed`, one
    Adam step per `sequences_per_step` sequences at `learning_rate`), as the module docstring
    describes, logging each epoch's held-out KL. Leaves both models' weights and their
    ``requires_grad`` as they were. ValueError for no train or held-out sequences,
    epochs < 1, a learning rate <= 0 or sequences_per_step < 1."""
    if not train or not held_out:
        raise ValueError("distillation needs training and held-out sequences")
    if epochs < 1 or not learning_rate > 0 or sequences_per_step < 1:
        raise ValueError(
            f"distillation needs epochs >= 1, a learning rate > 0 and sequences_per_step >= 1; "
            f"got {epochs}, {learning_rate}, {sequences_per_step}"
        )
    device = next(served_model.parameters()).device
    deltas = {
        name: LowRankDelta(
            down=d.down.detach().to(device, torch.float32, copy=True).requires_grad_(),
            up=d.up.detach().to(device, torch.float32, copy=True).requires_grad_(),
        )
        for name, d in adapter.layers.items()
    }
    optimizer = torch.optim.Adam(
        [t for d in deltas.values() for t in (d.down, d.up)], learning_rate
    )
    shuffle = random.Random(seed)
    with _frozen(served_model), _frozen(clean_model):
        history = [_held_out_kl(clean_model, served_model, deltas, held_out)]
        best = (history[0], adapter, 0)
        for epoch in range(1, epochs + 1):
            started = time.monotonic()
            order = list(train)
            shuffle.shuffle(order)
            for start in range(0, len(order), sequences_per_step):
                batch = order[start : start + sequences_per_step]
                positions = sum(len(s.token_ids) - s.prompt_length for s in batch)
                with applied_deltas(served_model, deltas):
                    for sequence in batch:
                        kl = _completion_kl(clean_model, served_model, sequence)
                        (kl[torch.isfinite(kl)].sum() / positions).backward()
                optimizer.step()
                optimizer.zero_grad()
            history.append(_held_out_kl(clean_model, served_model, deltas, held_out))
            logger.info(
                "distillation epoch %d: held-out KL %.5f (%.0f s)",
                epoch,
                history[-1],
                time.monotonic() - started,
            )
            if history[-1] < best[0]:
                best = (history[-1], _detached(deltas, adapter), epoch)
    return Distillation(adapter=best[1], best_epoch=best[2], held_out_kl=tuple(history))
