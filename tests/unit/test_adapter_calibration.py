"""`calibrate_adapter` on the tiny model and its int4 copy: which sequences each fit sees."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from noisy_temp_server.calibration import adapter_calibration
from noisy_temp_server.calibration.profile import CalibrationSettings
from noisy_temp_server.pairs.loading import LoadedPair, load_pair
from noisy_temp_server.pairs.perturbation import QuantizationSpec
from noisy_temp_server.pairs.scorer import ScoringSequence


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> LoadedPair:
    return load_pair(tiny_model_dir, spec=QuantizationSpec(format="int4", group_size=32))


def _sequences(count: int) -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(0)
    return [
        ScoringSequence(torch.randint(3, 500, (24,), generator=generator).tolist(), 8, i)
        for i in range(count)
    ]


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
    settings = CalibrationSettings(prompts=12, adapter_rank=4, adapter_method=method)
    calibration = adapter_calibration.calibrate_adapter(
        pair, _sequences(12), settings, rank=4, method=method
    )
    return calibration, fits


def test_the_chosen_ridge_is_refitted_on_the_fit_and_selection_prompts(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration, fits = _calibrate_recording_fits(pair, "propagated", monkeypatch)
    *tried, (refit_ids, refit_ridge, refitted) = fits
    ridges = adapter_calibration.RIDGES["propagated"]
    assert [ridge for _, ridge, _ in tried] == list(ridges)
    fit_ids = tried[0][0]
    assert all(ids == fit_ids for ids, _, _ in tried)
    selection_kl = calibration.selection_kl
    chosen = min(selection_kl, key=lambda r: selection_kl[r])
    assert calibration.summary.ridge == chosen == refit_ridge
    assert refit_ids > fit_ids  # the selection half joins the fit prompts
    gate_and_test = set(range(12)) - refit_ids
    assert gate_and_test  # the gate half and the test prompts stay unseen
    assert calibration.summary.test is not None
    assert calibration.adapter is refitted


def test_the_plain_svd_fit_reads_no_inputs_and_is_not_refitted(
    pair: LoadedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fits = _calibrate_recording_fits(pair, "svd", monkeypatch)
    assert len(fits) == 1
