"""The head map: a linear correction of the served row in the output head's span, fitted by
ridge least squares on paired rows and measured against the rows as served."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from noisy_temp_server.calibration.bias_fit import calibrate_bias
from noisy_temp_server.calibration.profile import CalibrationSettings
from noisy_temp_server.correction.files import (
    find_head_map_file,
    head_map_file_name,
    head_map_sha256,
    load_head_map_file,
    save_head_map_file,
)
from noisy_temp_server.correction.head_map import HeadMap, fit_head_map, head_coordinates
from noisy_temp_server.correction.paired_rows import (
    MASKED_FLOOR,
    LogitBias,
    PairedRows,
    evaluate_bias,
)

VOCAB, WIDTH = 300, 16
BASIS = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0))
# The served model's final hidden state is a fixed rank-2 linear function of the clean one:
# the error h - h~ = A h~ + noise, the same on every prompt.
_GENERATOR = torch.Generator().manual_seed(1)
DISTORTION = (
    0.3 * torch.randn(WIDTH, 2, generator=_GENERATOR) @ torch.randn(2, WIDTH, generator=_GENERATOR)
)
HIDDEN_MEAN = torch.randn(WIDTH, generator=_GENERATOR)  # final hidden states are not centred


def _rows(sequence: int, rows: int = 40, noise: float = 0.05) -> PairedRows:
    """Clean rows W h + c and served rows W h~ + c' with h = (1 + A) h~ + noise (c, c': row
    constants the coordinates must ignore)."""
    generator = torch.Generator().manual_seed(100 + sequence)
    served_hidden = HIDDEN_MEAN + torch.randn(rows, WIDTH, generator=generator)
    clean_hidden = served_hidden + served_hidden @ DISTORTION.T
    clean_hidden += noise * torch.randn(rows, WIDTH, generator=generator)
    constants = 5 * torch.randn(2, rows, 1, generator=generator)
    clean = clean_hidden @ BASIS.T + constants[0]
    served = served_hidden @ BASIS.T + constants[1]
    return PairedRows.from_logits(clean, served, sequence)


def _mean_kl(rows: PairedRows) -> float:
    return float(evaluate_bias(rows, LogitBias.identity(VOCAB)).kl.mean())


def test_coordinates_read_the_hidden_state_off_a_row_whatever_its_constant() -> None:
    hidden = torch.randn(3, WIDTH, dtype=torch.float64)
    row = hidden @ BASIS.double().T + torch.tensor([[2.0], [-7.0], [0.0]], dtype=torch.float64)
    torch.testing.assert_close(row @ head_coordinates(BASIS).T, hidden)


def test_a_map_ignores_a_constant_added_to_the_row() -> None:
    head_map = HeadMap(left=torch.randn(VOCAB, 3), right=head_coordinates(BASIS)[:3].float())
    row = torch.randn(2, VOCAB)
    torch.testing.assert_close(head_map.apply(row + 4.0), head_map.apply(row) + 4.0)


def test_the_fitted_map_removes_a_linear_distortion_on_rows_it_never_saw() -> None:
    fit = PairedRows.concat([_rows(s) for s in range(10)])
    selection = PairedRows.concat([_rows(s) for s in range(10, 14)])
    held_out = PairedRows.concat([_rows(s) for s in range(14, 20)])
    result = fit_head_map(fit, selection, BASIS, rank=2)
    assert result.head_map.rank == 2
    assert result.penalty == min(result.selection_kl, key=result.selection_kl.__getitem__)
    # scored with the constant its fit predicts, the chosen map removes nearly all of the KL
    assert result.selection_kl[result.penalty] < 0.05 * _mean_kl(selection)
    assert result.penalty < max(result.selection_kl)
    assert _mean_kl(result.head_map.mapped(held_out)) < 0.1 * _mean_kl(held_out)


def test_a_map_cut_below_the_distortions_rank_removes_less() -> None:
    fit = PairedRows.concat([_rows(s) for s in range(10)])
    selection = PairedRows.concat([_rows(s) for s in range(10, 14)])
    held_out = PairedRows.concat([_rows(s) for s in range(14, 20)])
    full = fit_head_map(fit, selection, BASIS, rank=2).head_map
    cut = fit_head_map(fit, selection, BASIS, rank=1).head_map
    assert _mean_kl(full.mapped(held_out)) < 0.5 * _mean_kl(cut.mapped(held_out))


def test_rows_with_a_masked_token_are_refused() -> None:
    rows = _rows(0)
    masked = replace(
        rows, served_shifted=rows.served_shifted.index_fill(1, torch.tensor([3]), MASKED_FLOOR)
    )
    with pytest.raises(ValueError, match="masked"):
        fit_head_map(rows, masked, BASIS, rank=2)


@pytest.mark.parametrize(
    ("rank", "penalties", "message"),
    [
        (0, (1.0,), "rank"),
        (WIDTH + 1, (1.0,), "rank"),
        (2, (), "penalties"),
        (2, (0.0,), "penalties"),
    ],
)
def test_bad_fit_arguments_are_refused(
    rank: int, penalties: tuple[float, ...], message: str
) -> None:
    rows = _rows(0)
    with pytest.raises(ValueError, match=message):
        fit_head_map(rows, rows, BASIS, rank=rank, penalties=penalties)


def test_a_calibration_on_top_of_a_map_is_measured_against_the_rows_as_served() -> None:
    """The share removed is the map's and the bias's together, against T = 1 and the oracle of
    the served rows; such a calibration cannot be written to a profile (not servable)."""
    rows = PairedRows.concat([_rows(s) for s in range(30)])
    settings = CalibrationSettings(prompts=30, min_quality_positions=40)
    mapped = calibrate_bias(rows, settings, BASIS, head_map_rank=2)
    plain = calibrate_bias(rows, settings, BASIS)
    assert mapped.head_map is not None
    assert mapped.test.t_one.mean_kl == pytest.approx(plain.test.t_one.mean_kl)
    assert mapped.test.oracle.mean_kl == pytest.approx(plain.test.oracle.mean_kl)
    assert mapped.test.share_removed > 0.9 > plain.test.share_removed
    assert "Head map (rank 2" in mapped.to_markdown()
    summary = mapped.summary()
    assert mapped.head_map is not None
    assert summary.head_map == head_map_sha256(mapped.head_map.head_map)
    assert (summary.head_map_rank, summary.head_map_penalty) == (2, mapped.head_map.penalty)
    assert plain.summary().head_map is None
    with pytest.raises(ValueError, match="basis"):
        calibrate_bias(rows, settings, head_map_rank=2)


def _small_map(seed: int = 3) -> HeadMap:
    generator = torch.Generator().manual_seed(seed)
    return HeadMap(
        left=torch.randn(VOCAB, 2, generator=generator),
        right=torch.randn(2, VOCAB, generator=generator),
    )


def test_a_stored_map_is_found_by_its_hash_and_a_changed_file_is_refused(tmp_path: Path) -> None:
    head_map = _small_map()
    sha = head_map_sha256(head_map)
    path = save_head_map_file(tmp_path, head_map)
    assert path.name == head_map_file_name(sha)
    found = find_head_map_file([tmp_path / "elsewhere", tmp_path], sha)
    torch.testing.assert_close(found.left, head_map.left, rtol=0, atol=0)
    torch.testing.assert_close(found.right, head_map.right, rtol=0, atol=0)
    assert head_map_sha256(_small_map(seed=4)) != sha
    assert head_map.to("cpu") is head_map
    save_file({"left": head_map.left, "right": 2 * head_map.right}, str(path))
    with pytest.raises(ValueError, match="does not hold the map"):
        load_head_map_file(tmp_path, sha)
    save_file({"left": head_map.left}, str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_head_map_file(tmp_path, sha)
    with pytest.raises(ValueError, match=r"no head map file head-map-.* in"):
        find_head_map_file([tmp_path / "elsewhere"], sha)
