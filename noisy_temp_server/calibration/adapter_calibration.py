"""Calibrating the compensation adapter of a pair, before everything else calibration fits.

`calibrate_adapter` takes completions sampled by the served model (without an adapter) for all
the calibration prompts, split by prompt as the rest of calibration splits them
(`split_fit_validation_test`, `split_selection_gate`, same seed). It fits the adapter
(`adapter.layer_fit.fit_compensation_adapter`) on the fit prompts' sequences once per ridge of
`RIDGES` for its method (one fit for ``svd``), keeps the ridge with the lowest KL(clean ||
served + adapter) at T = 1 on the selection half, refits it with that ridge on the fit and
selection prompts together (for the methods that read inputs: not ``svd``), and measures
the kept adapter against the served model without it, both at T = 1, on the gate half (which
decides `recommended`: a significant gain, `is_significant`) and on the test prompts (the
figure to quote); neither half was fitted on. With `CalibrationSettings.adapter_fit_completions`
K > 1, the refit also reads K - 1 more completions of each fit and selection prompt, sampled
without the adapter (seeds `seed` + 1 ... `seed` + K - 1); the ridges are still chosen on one.
The adapter is applied by forward hooks (`applied_adapter`): the served model's weights are
never written.

With `CalibrationSettings.adapter_distil_epochs`, the kept adapter is then distilled
(`adapter.distillation`) on the fit prompts' completions: the one sampled without it and
`adapter_distil_completions - 1` more sampled with it (seeds after the refit's), the epoch
kept chosen on the selection half (whose completions its fit saw, as inputs only), before
the gate and the test measure it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from noisy_temp_server.adapter.distillation import distil_adapter
from noisy_temp_server.adapter.layer_fit import (
    AdapterMethod,
    applied_deltas,
    fit_compensation_adapter,
    reads_inputs,
)
from noisy_temp_server.adapter.lora import LoraAdapter, adapter_sha256
from noisy_temp_server.calibration.completions import sample_completions
from noisy_temp_server.calibration.profile import AdapterDistillation, AdapterSummary, QualityRow
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.quality import quality_row
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    is_significant,
    split_fit_validation_test,
    split_selection_gate,
)
from noisy_temp_server.checkpoints.loading import LoadedPair
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = [
    "RIDGES",
    "AdapterCalibration",
    "adapter_kl_records",
    "adapter_quality_row",
    "applied_adapter",
    "calibrate_adapter",
]

RIDGES: dict[AdapterMethod, tuple[float | None, ...]] = {
    "eora": (1e-3, 1e-2, 1e-1),
    "propagated": (3.0, 10.0, 30.0),
    "svd": (None,),
}
"""The relative ridges tried for each fit method (times the mean input eigenvalue;
`fit_compensation_adapter`): ``eora`` ridges its input covariances, ``propagated`` pulls each
layer's target towards its own error; ``svd`` has none."""

RIDGE_EXTENSIONS = 2
"""How many ridges beyond an edge of `RIDGES` are tried, one grid step at a time, while the
selection KL is still lowest at that edge (`_ridges`)."""

DISTILLATION_LEARNING_RATE = 1e-5
"""Adam's step size for the adapter's distillation (docs/adapter.md: 1e-4 diverges)."""


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterCalibration:
    """The kept adapter (fitted with the chosen ridge on the fit and selection prompts; the
    single fit for ``svd``), its summary for the profile, and the selection KL of each ridge's
    candidate, fitted on the fit prompts alone ({ridge: mean KL at T = 1}; {None: ...} for
    ``svd``)."""

    adapter: LoraAdapter
    summary: AdapterSummary
    selection_kl: dict[float | None, float]


@contextmanager
def applied_adapter(model: nn.Module, adapter: LoraAdapter | None) -> Iterator[None]:
    """Within the block, `model` computes as if `adapter` were folded into it (None: no
    change), by forward hooks (`applied_deltas`); the weights are not written."""
    with applied_deltas(model, {} if adapter is None else adapter.layers):
        yield


def _log_blocks(label: str) -> Callable[[int, int], None]:
    started = time.monotonic()

    def report(done: int, total: int) -> None:
        if done == total or done % 10 == 0:
            logger.info("%s: block %d/%d (%.0f s)", label, done, total, time.monotonic() - started)

    return report


def adapter_kl_records(
    pair: LoadedPair,
    sequences: Sequence[ScoringSequence],
    adapter: LoraAdapter | None,
    device: str | torch.device,
) -> PositionRecords:
    """The pair's records on `sequences`, the served model computing as if `adapter` (None:
    none) were folded into it (`applied_adapter`)."""
    scorer = PairScorer(
        pair.clean_model, pair.served_model, runtime_noise=pair.runtime_noise, device=device
    )
    with applied_adapter(pair.served_model, adapter):
        return scorer.score(sequences)


def adapter_quality_row(with_adapter: PositionRecords, without: PositionRecords) -> QualityRow:
    """KL at T = 1 of the served model with the adapter against without it, on the same
    positions (records of the same sequences, in order): the row ``adapter``, its gain paired
    position by position and clustered by sequence. ValueError for records of other positions."""
    if not torch.equal(with_adapter.sequence_id, without.sequence_id):
        raise ValueError("the adapter's quality compares the same positions with and without it")
    finite = torch.isfinite(with_adapter.kl_at_one) & torch.isfinite(without.kl_at_one)
    kl, base = with_adapter.kl_at_one[finite], without.kl_at_one[finite]
    kl_one = float(base.double().mean())
    return quality_row(
        "adapter",
        kl=kl,
        temperatures=torch.ones(len(kl)),
        sequence_ids=with_adapter.sequence_id[finite],
        kl_at_one=base,
        kl_one=kl_one,
        kl_oracle=kl_one,
        kl_fixed=None,
    )


def _split(
    sequences: Sequence[ScoringSequence], settings: CalibrationSettings
) -> tuple[
    list[ScoringSequence], list[ScoringSequence], list[ScoringSequence], list[ScoringSequence]
]:
    """(fit, selection, gate, test) sequences, as calibration splits their records."""
    ids = torch.tensor([s.sequence_id for s in sequences])
    fit, validation, test = split_fit_validation_test(
        ids, settings.validation_fraction, settings.test_fraction, settings.seed
    )
    selection, gate = split_selection_gate(ids[validation], settings.seed)
    validation_ids = set(ids[validation][selection].tolist()), set(ids[validation][gate].tolist())

    def pick(mask: Tensor) -> list[ScoringSequence]:
        return [s for s, keep in zip(sequences, mask.tolist(), strict=True) if keep]

    return (
        pick(fit),
        [s for s in sequences if s.sequence_id in validation_ids[0]],
        [s for s in sequences if s.sequence_id in validation_ids[1]],
        pick(test),
    )


def _more_completions(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    sequences: Sequence[ScoringSequence],
    *,
    count: int,
    adapter: LoraAdapter | None,
    first_seed: int,
    max_new_tokens: int,
) -> list[ScoringSequence]:
    """`count` more completions of the prompts of `sequences`, sampled as served with
    `adapter` (None: without one), seeds `first_seed`, `first_seed` + 1, ..., each with its
    prompt's id."""
    ids = [s.sequence_id for s in sequences]
    more: list[ScoringSequence] = []
    with applied_adapter(pair.served_model, adapter):
        for seed in range(first_seed, first_seed + count):
            sampled = sample_completions(
                pair, [prompts[i] for i in ids], max_new_tokens=max_new_tokens, seed=seed
            )
            more += [replace(s, sequence_id=ids[s.sequence_id]) for s in sampled]
    return more


def _refit_sequences(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    sequences: Sequence[ScoringSequence],
    settings: CalibrationSettings,
) -> list[ScoringSequence]:
    """`sequences` and `settings.adapter_fit_completions - 1` more completions of their
    prompts, sampled without the adapter (seeds `settings.seed` + 1, ...): the refit's data."""
    more = _more_completions(
        pair,
        prompts,
        sequences,
        count=settings.adapter_fit_completions - 1,
        adapter=None,
        first_seed=settings.seed + 1,
        max_new_tokens=settings.max_new_tokens,
    )
    return [*sequences, *more]


def _distilled(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    adapter: LoraAdapter,
    *,
    fit: Sequence[ScoringSequence],
    selection: Sequence[ScoringSequence],
    settings: CalibrationSettings,
) -> tuple[LoraAdapter, AdapterDistillation]:
    """`adapter` distilled (module docstring) on `fit` and more completions of its prompts,
    the epoch kept chosen on `selection`, with what the profile records of it."""
    more = _more_completions(
        pair,
        prompts,
        fit,
        count=settings.adapter_distil_completions - 1,
        adapter=adapter,
        first_seed=settings.seed + settings.adapter_fit_completions,
        max_new_tokens=settings.max_new_tokens,
    )
    train = [*fit, *more]
    started = time.monotonic()
    distillation = distil_adapter(
        pair.clean_model,
        pair.served_model,
        adapter,
        train,
        selection,
        epochs=settings.adapter_distil_epochs,
        learning_rate=DISTILLATION_LEARNING_RATE,
        seed=settings.seed,
    )
    logger.info(
        "adapter distilled in %.0f s on %d sequences: epoch %d kept, selection KL %s",
        time.monotonic() - started,
        len(train),
        distillation.best_epoch,
        " -> ".join(f"{kl:.5f}" for kl in distillation.held_out_kl),
    )
    return distillation.adapter, AdapterDistillation(
        epochs=settings.adapter_distil_epochs,
        kept_epoch=distillation.best_epoch,
        selection_kl=distillation.held_out_kl,
    )


def _ridges(
    method: AdapterMethod, selection_kl: dict[float | None, float]
) -> Iterator[float | None]:
    """The ridges to try for `method`: its grid (`RIDGES`), then, while the lowest KL so far
    (read from `selection_kl` as it fills) is at an edge of what was tried, up to
    `RIDGE_EXTENSIONS` more beyond that edge, each one grid step further (the ratio of the
    grid's two values at that edge)."""
    yield from RIDGES[method]
    grid = [ridge for ridge in RIDGES[method] if ridge is not None]
    if len(grid) < 2:
        return
    for _ in range(RIDGE_EXTENSIONS):
        tried = sorted(r for r in selection_kl if r is not None and math.isfinite(selection_kl[r]))
        if not tried:
            return
        best = min(tried, key=selection_kl.__getitem__)
        if best == tried[-1]:
            yield best * grid[-1] / grid[-2]
        elif best == tried[0]:
            yield best * grid[0] / grid[1]
        else:
            return


def _choose_ridge(
    fitted: Callable[[float | None], LoraAdapter],
    pair: LoadedPair,
    selection: Sequence[ScoringSequence],
    method: AdapterMethod,
    device: str | torch.device,
) -> tuple[float | None, dict[float | None, float], LoraAdapter]:
    """The ridge of `method` (among `_ridges`) whose adapter (`fitted(ridge)`) gives the lowest
    KL at T = 1 on `selection`, the selection KL of each, and the last adapter fitted (one at a
    time is held). ValueError when every ridge's KL is non-finite."""
    selection_kl: dict[float | None, float] = {}
    for ridge in _ridges(method, selection_kl):
        adapter = fitted(ridge)
        records = adapter_kl_records(pair, selection, adapter, device)
        kl = float(records.kl_at_one[torch.isfinite(records.kl_at_one)].double().mean())
        logger.info("adapter ridge %s: selection KL %.5f", ridge, kl)
        selection_kl[ridge] = kl
    finite = {r: kl for r, kl in selection_kl.items() if math.isfinite(kl)}
    if not finite:
        raise ValueError("every ridge's adapter gave a non-finite KL on the selection prompts")
    return min(finite, key=finite.__getitem__), selection_kl, adapter


def calibrate_adapter(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    sequences: Sequence[ScoringSequence],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
) -> AdapterCalibration:
    """Fit, choose (and distil) and measure the pair's adapter of `settings.adapter_rank` and
    `settings.adapter_method` on `sequences` (sampled by the served model without one; ids
    index `prompts`), as the module docstring describes. ValueError when the pair's served
    weights equal the clean ones, for a rank a layer cannot take (`adapter_targets`), or when
    a split is empty."""
    fit, selection, gate, test = _split(sequences, settings)
    rank, method = settings.adapter_rank, settings.adapter_method

    def fitted(on: Sequence[ScoringSequence], ridge: float | None) -> LoraAdapter:
        started = time.monotonic()
        adapter = fit_compensation_adapter(
            pair.clean_model,
            pair.served_model,
            on,
            rank=rank,
            method=method,
            ridge=ridge or 1.0,
            base_model=pair.clean.name,
            progress=_log_blocks(f"adapter fit (ridge {ridge})"),
        )
        logger.info(
            "adapter rank %d %s ridge %s: fitted in %.1f s on %d sequences",
            rank,
            method,
            ridge,
            time.monotonic() - started,
            len(on),
        )
        return adapter

    ridge, selection_kl, adapter = _choose_ridge(
        lambda ridge: fitted(fit, ridge), pair, selection, method, device
    )
    if reads_inputs(method):  # else one ridge, one candidate: the adapter kept
        del adapter  # only one adapter in memory at a time: the candidates keep just their KL
        adapter = fitted(_refit_sequences(pair, prompts, [*fit, *selection], settings), ridge)
    distillation = None
    if settings.adapter_distil_epochs:
        adapter, distillation = _distilled(
            pair, prompts, adapter, fit=fit, selection=selection, settings=settings
        )
    validation, test_row = (
        adapter_quality_row(
            adapter_kl_records(pair, split, adapter, device),
            adapter_kl_records(pair, split, None, device),
        )
        for split in (gate, test)
    )
    summary = AdapterSummary(
        sha256=adapter_sha256(adapter),
        rank=rank,
        target_modules=tuple(adapter.target_modules),
        layers=len(adapter.layers),
        method=method,
        ridge=ridge,
        distillation=distillation,
        recommended=is_significant(validation.gain, validation.gain_stderr)
        and math.isfinite(validation.gain),
        validation=validation,
        test=test_row,
    )
    return AdapterCalibration(adapter=adapter, summary=summary, selection_kl=selection_kl)
