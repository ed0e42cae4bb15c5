"""`calibrate_adapter` on the tiny model and its int4 copy: which sequences each fit sees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from noisy_temp_server.calibration import adapter_calibration
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.loading import LoadedPair, load_pair
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec
from noisy_temp_server.scoring.sequence import ScoringSequence


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> LoadedPair:
    return load_pair(tiny_model_dir, spec=QuantizationSpec(format="int4", group_size=32))


def _sequences(count: int) -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(0)
    return [
        ScoringSequence(torch.randint(3, 500, (24,), generator=generator).tolist(), 8, i)
        for i in range(count)
    ]


SETTINGS = {"prompts": 12, "adapter_rank": 4}
PROMPTS = [Prompt(str(i), f"What is {i} plus {i + 1}?") for i in range(12)]


def _calibrate_recording_fits(
    pair: LoadedPair, method: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[adapter_calibration.AdapterCalibration, list[tuple[set[int], float, Any]]]:
    fits: list[tuple[set[int], float, Any]] = []
    real_fit = adapter_calibration.fit_compensation_adapter

    def recording_fit(
        clean: Any, served: Any, sequences: Sequence[ScoringSequence], **kwargs: Any
    ) -> Any:
        adapter = real_fit(clean, served, sequences, **kwargs)
        fits.append(({s.sequence_id for s in sequences}, kwargs["ridge"], adapter))
        return adapter

    monkeypatch.setattr(adapter_calibration, "fit_compensation_adapter", recording_fit)
    settings = CalibrationSettings(**SETTINGS, adapter_method=method)
    calibration = adapter_calibration.calibrate_adapter(pair, PROMPTS, _sequences(12), settings)
    return calibration, fits


def _split_ids() -> tuple[set[int], ...]:
    """The (fit, selection, gate, test) prompt ids of `_sequences(12)`."""
    splits = adapter_calibration._split(_sequences(12), CalibrationSettings(**SETTINGS))
    return tuple({s.sequence_id for s in split} for split in splits)


def test_the_chosen_ridge_is_refitted_on_the_fit_and_selection_prompts(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration, fits = _calibrate_recording_fits(pair, "propagated", monkeypatch)
    fit_ids, selection_ids, gate_ids, test_ids = _split_ids()
    *tried, (refit_ids, refit_ridge, refitted) = fits
    grid = adapter_calibration.RIDGES["propagated"]
    assert tuple(ridge for _, ridge, _ in tried[: len(grid)]) == grid
    assert len(tried) == len(calibration.selection_kl)
    assert all(ids == fit_ids for ids, _, _ in tried)
    selection_kl = calibration.selection_kl
    assert calibration.summary.ridge == min(selection_kl, key=lambda r: selection_kl[r])
    assert refit_ridge == calibration.summary.ridge
    assert refit_ids == fit_ids | selection_ids
    assert refit_ids.isdisjoint(gate_ids | test_ids)  # what judges and measures it stays unseen
    assert calibration.adapter is refitted


def test_the_plain_svd_fit_reads_no_inputs_and_is_not_refitted(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration, fits = _calibrate_recording_fits(pair, "svd", monkeypatch)
    ((_, _, only),) = fits
    assert calibration.adapter is only


def test_the_test_row_measures_against_the_served_model_without_the_adapter(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration, _ = _calibrate_recording_fits(pair, "eora", monkeypatch)
    test = [s for s in _sequences(12) if s.sequence_id in _split_ids()[3]]
    without = adapter_calibration.adapter_kl_records(pair, test, None, "cpu").kl_at_one
    with_adapter = adapter_calibration.adapter_kl_records(
        pair, test, calibration.adapter, "cpu"
    ).kl_at_one
    row = calibration.summary.test
    assert row.baseline_kl == pytest.approx(float(without.double().mean()), rel=1e-5)
    assert row.mean_kl == pytest.approx(float(with_adapter.double().mean()), rel=1e-5)
    assert row.mean_kl < row.baseline_kl


def test_distillation_trains_on_more_completions_of_the_fit_prompts_and_stops_on_selection(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    real_distil = adapter_calibration.distil_adapter

    def recording_distil(
        clean: Any, served: Any, adapter: Any, train: Any, held_out: Any, **kw: Any
    ) -> Any:
        seen.update(train=list(train), held_out=list(held_out), start=adapter, **kw)
        return real_distil(clean, served, adapter, train, held_out, **kw)

    monkeypatch.setattr(adapter_calibration, "distil_adapter", recording_distil)
    settings = CalibrationSettings(
        **SETTINGS,
        adapter_method="eora",
        adapter_distil_epochs=2,
        adapter_distil_completions=3,
        max_new_tokens=6,
    )
    calibration = adapter_calibration.calibrate_adapter(pair, PROMPTS, _sequences(12), settings)
    fit_ids, selection_ids, _, _ = _split_ids()
    train_ids = [s.sequence_id for s in seen["train"]]
    assert sorted(train_ids) == sorted(list(fit_ids) * 3)  # three completions of each fit prompt
    assert {s.sequence_id for s in seen["held_out"]} == selection_ids
    assert seen["epochs"] == 2
    distillation = calibration.summary.distillation
    assert distillation is not None
    assert (distillation.epochs, len(distillation.selection_kl)) == (2, 3)
    kept = distillation.kept_epoch
    assert distillation.selection_kl[kept] == min(distillation.selection_kl)
    if kept:
        assert calibration.adapter is not seen["start"]
    assert calibration.summary.sha256 == adapter_calibration.adapter_sha256(calibration.adapter)


def test_the_refit_reads_more_completions_and_distillation_samples_after_them(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three completions per prompt for the refit (two more, sampled without the adapter, seeds
    1 and 2), one for each ridge tried; the distillation's extra completion, sampled with the
    adapter, takes the next seed."""
    sampled: list[tuple[int, int, bool]] = []
    real_sample = adapter_calibration.sample_completions

    def recording_sample(pair_: LoadedPair, prompts: Any, **kwargs: Any) -> Any:
        adapted = any(module._forward_hooks for module in pair_.served_model.modules())
        sampled.append((kwargs["seed"], len(prompts), adapted))
        return real_sample(pair_, prompts, **kwargs)

    monkeypatch.setattr(adapter_calibration, "sample_completions", recording_sample)
    fits: list[list[int]] = []
    real_fit = adapter_calibration.fit_compensation_adapter

    def recording_fit(clean: Any, served: Any, sequences: Any, **kwargs: Any) -> Any:
        fits.append(sorted(s.sequence_id for s in sequences))
        return real_fit(clean, served, sequences, **kwargs)

    monkeypatch.setattr(adapter_calibration, "fit_compensation_adapter", recording_fit)
    settings = CalibrationSettings(
        **SETTINGS,
        adapter_method="eora",
        adapter_fit_completions=3,
        adapter_distil_epochs=1,
        adapter_distil_completions=2,
        max_new_tokens=6,
    )
    adapter_calibration.calibrate_adapter(pair, PROMPTS, _sequences(12), settings)
    fit_ids, selection_ids, _, _ = _split_ids()
    *tried, refit = fits
    assert all(ids == sorted(fit_ids) for ids in tried)
    assert refit == sorted(list(fit_ids | selection_ids) * 3)
    refit_prompts = len(fit_ids | selection_ids)
    assert sampled == [
        (1, refit_prompts, False),
        (2, refit_prompts, False),
        (3, len(fit_ids), True),
    ]


def test_without_distillation_the_summary_says_none(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration, _ = _calibrate_recording_fits(pair, "svd", monkeypatch)
    assert calibration.summary.distillation is None


def _tried(method: Any, kl_of: Callable[[float], float]) -> list[float | None]:
    """The ridges `_ridges` yields when each tried ridge's selection KL is `kl_of(ridge)`."""
    selection_kl: dict[float | None, float] = {}
    for ridge in adapter_calibration._ridges(method, selection_kl):
        assert ridge is not None
        selection_kl[ridge] = kl_of(ridge)
    return list(selection_kl)


def test_ridges_go_past_the_grid_while_the_kl_still_falls_at_its_edge() -> None:
    assert _tried("propagated", lambda r: abs(r - 10)) == [3.0, 10.0, 30.0]
    assert _tried("propagated", lambda r: abs(r - 100)) == [3.0, 10.0, 30.0, 90.0, 270.0]
    assert _tried("propagated", lambda r: abs(r - 50)) == [3.0, 10.0, 30.0, 90.0]
    assert _tried("propagated", lambda r: 1 / r) == [3.0, 10.0, 30.0, 90.0, 270.0]  # at most 2
    assert _tried("propagated", lambda r: r) == pytest.approx([3.0, 10.0, 30.0, 0.9, 0.27])
    assert _tried("eora", lambda r: r) == pytest.approx([1e-3, 1e-2, 1e-1, 1e-4, 1e-5])
    assert list(adapter_calibration._ridges("svd", {})) == [None]
