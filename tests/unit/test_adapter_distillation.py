"""`distil_adapter` on the tiny model and its int4 copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noisy_temp_server.adapter.distillation import Distillation, distil_adapter
from noisy_temp_server.adapter.layer_fit import fit_compensation_adapter
from noisy_temp_server.adapter.lora import LoraAdapter, adapter_sha256
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec
from noisy_temp_server.scoring.sequence import ScoringSequence


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> LoadedPair:
    return load_pair(tiny_model_dir, spec=QuantizationSpec(format="int4", group_size=32))


def _sequences(count: int, seed: int) -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(seed)
    return [
        ScoringSequence(torch.randint(3, 500, (24,), generator=generator).tolist(), 8, i)
        for i in range(count)
    ]


def _distilled_on_their_own_sequences(
    pair: LoadedPair, count: int, *, seed: int, epochs: int, learning_rate: float
) -> tuple[LoraAdapter, Distillation]:
    """(the fitted start, its distillation), trained and held out on the same sequences."""
    sequences = _sequences(count, seed)
    start = fit_compensation_adapter(pair.clean_model, pair.served_model, sequences, rank=2)
    return start, distil_adapter(
        pair.clean_model,
        pair.served_model,
        start,
        sequences,
        sequences,
        epochs=epochs,
        learning_rate=learning_rate,
    )


def test_distillation_lowers_the_kl_it_trains_on_and_keeps_the_best_epoch(
    pair: LoadedPair,
) -> None:
    start, result = _distilled_on_their_own_sequences(pair, 6, seed=0, epochs=3, learning_rate=1e-3)
    history = result.held_out_kl
    assert len(history) == 4
    assert min(history[1:]) < 0.9 * history[0]
    assert result.best_epoch == min(range(4), key=history.__getitem__)
    assert adapter_sha256(result.adapter) != adapter_sha256(start)
    assert result.adapter.rank == start.rank
    assert set(result.adapter.layers) == set(start.layers)


def test_distillation_never_returns_an_adapter_worse_on_the_held_out_sequences(
    pair: LoadedPair,
) -> None:
    # steps this large only make it worse
    start, result = _distilled_on_their_own_sequences(pair, 4, seed=1, epochs=2, learning_rate=10.0)
    assert min(result.held_out_kl[1:]) > result.held_out_kl[0]
    assert result.best_epoch == 0
    assert result.adapter is start


def test_distillation_leaves_both_models_as_they_were(pair: LoadedPair) -> None:
    before = {k: v.clone() for k, v in pair.served_model.state_dict().items()}
    flags = [p.requires_grad for p in pair.served_model.parameters()]
    _distilled_on_their_own_sequences(pair, 3, seed=2, epochs=1, learning_rate=1e-3)
    after = pair.served_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.requires_grad for p in pair.served_model.parameters()] == flags
    assert all(p.grad is None for p in pair.served_model.parameters())


@pytest.mark.parametrize(
    ("epochs", "learning_rate", "held_out"),
    [(0, 1e-3, True), (1, 0.0, True), (1, 1e-3, False)],
)
def test_distillation_refuses_what_it_cannot_run(
    pair: LoadedPair, epochs: int, learning_rate: float, held_out: bool
) -> None:
    sequences = _sequences(2, seed=3)
    start = fit_compensation_adapter(pair.clean_model, pair.served_model, sequences, rank=2)
    with pytest.raises(ValueError, match="distillation needs"):
        distil_adapter(
            pair.clean_model,
            pair.served_model,
            start,
            sequences,
            sequences if held_out else [],
            epochs=epochs,
            learning_rate=learning_rate,
        )
