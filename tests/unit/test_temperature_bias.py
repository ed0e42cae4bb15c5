"""Per-token logit bias + T: objective, fit, penalty choice, evaluation (torch only)."""

from __future__ import annotations

import math

import pytest
import torch
from kl_reference import kl_to_clean

from noisy_temp_server.correction.bias import fit_bias_at_penalty, fit_logit_bias
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows, evaluate_bias
from noisy_temp_server.correction.request_bands import best_temperature
from noisy_temp_server.temperature.rules import TemperatureBounds
from noisy_temp_server.temperature.stats import pair_statistics

VOCAB = 300


def _pair(rows: int, seed: int, shift: torch.Tensor | None, noise: float = 0.3):
    """Clean logits, and served = clean + shift (the systematic part) + fresh noise per row."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64) * 3
    served = clean + noise * torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64)
    if shift is not None:
        served = served + shift
    return clean, served


def _rows(rows: int, seed: int, shift: torch.Tensor | None, noise: float = 0.3) -> PairedRows:
    clean, served = _pair(rows, seed, shift, noise)
    return PairedRows.from_logits(clean, served, torch.arange(rows) // 8)


@pytest.fixture(scope="module")
def shift() -> torch.Tensor:
    return 0.6 * torch.randn(
        VOCAB, generator=torch.Generator().manual_seed(42), dtype=torch.float64
    )


def test_identity_evaluation_is_the_kl_at_one_and_the_pair_top() -> None:
    clean, served = _pair(40, 0, None)
    rows = PairedRows.from_logits(clean, served, 0)
    evaluation = evaluate_bias(rows, LogitBias.identity(VOCAB))
    stats = pair_statistics(clean, served)
    torch.testing.assert_close(evaluation.kl, stats.kl_at_one.double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(evaluation.same_top, stats.same_top)


def test_evaluation_matches_the_exact_kl_of_the_corrected_logits(shift: torch.Tensor) -> None:
    clean, served = _pair(30, 1, shift)
    correction = LogitBias(bias=torch.randn(VOCAB) * 0.5, temperature=1.3)
    rows = PairedRows.from_logits(clean, served, 0)
    expected = kl_to_clean(clean, correction.apply(served.float()).double(), 1.0)
    torch.testing.assert_close(evaluate_bias(rows, correction).kl, expected, rtol=1e-4, atol=1e-6)


def test_rows_masking_a_supported_token_are_left_out() -> None:
    clean, served = _pair(5, 2, None)
    served[1, clean[1].argmax()] = -math.inf
    served[3, clean[3].argmin()] = -math.inf  # masks a token p supports (tiny but > 0)
    clean[4, 7] = -math.inf
    served[4, 7] = -math.inf  # masked in both rows: kept
    rows = PairedRows.from_logits(clean, served, torch.arange(5))
    assert rows.sequence_id.tolist() == [0, 2, 4]
    assert torch.isfinite(evaluate_bias(rows, LogitBias.identity(VOCAB)).kl).all()


def test_a_systematic_per_token_shift_is_recovered(shift: torch.Tensor) -> None:
    train, validation, test = (_rows(n, seed, shift) for n, seed in ((600, 3), (200, 4), (200, 5)))
    path = fit_logit_bias(train, validation)
    correction = path.chosen.correction
    centred = -(shift - shift.mean()).float()
    assert torch.corrcoef(torch.stack([correction.bias, centred]))[0, 1] > 0.97
    assert math.isfinite(path.chosen.penalty)
    assert abs(float(correction.bias.sum())) < 1e-3
    kl_one = evaluate_bias(test, LogitBias.identity(VOCAB)).kl.mean()
    kl_fit = evaluate_bias(test, correction).kl.mean()
    assert kl_fit < 0.4 * kl_one  # most of the drift was the shift


def test_without_a_systematic_part_the_bias_is_not_worse_than_t_one() -> None:
    train, validation, test = (
        _rows(n, seed, None, 0.8) for n, seed in ((200, 6), (200, 7), (400, 8))
    )
    path = fit_logit_bias(train, validation)
    kl_one = float(evaluate_bias(test, LogitBias.identity(VOCAB)).kl.mean())
    kl_fit = float(evaluate_bias(test, path.chosen.correction).kl.mean())
    assert kl_fit <= kl_one
    assert path.chosen.correction.temperature > 1.0  # pure noise: the served row is too sharp
    t_only = path.validation_kl[math.inf]
    assert path.validation_kl[path.chosen.penalty] <= t_only


def test_the_fit_reaches_the_penalised_optimum(shift: torch.Tensor) -> None:
    """The objective's gradient vanishes at the fit: a perturbation of b or T never helps."""
    rows = _rows(300, 9, shift)
    fit = fit_bias_at_penalty(rows, 1e-3)

    def penalised(correction: LogitBias) -> float:
        c = correction.bias.double() / correction.temperature
        kl = float(evaluate_bias(rows, correction).kl.mean())
        return kl + 0.5e-3 * float(c @ c)

    best = penalised(fit.correction)
    generator = torch.Generator().manual_seed(10)
    for _ in range(5):
        nudged = LogitBias(
            bias=fit.correction.bias + 0.05 * torch.randn(VOCAB, generator=generator),
            temperature=fit.correction.temperature * 1.02,
        )
        assert penalised(nudged) > best


def test_the_t_only_fit_is_the_best_shared_temperature() -> None:
    clean, served = _pair(100, 11, None, 1.0)
    rows = PairedRows.from_logits(clean, served, 0)
    fit = fit_bias_at_penalty(rows, math.inf, fit_bias=False)
    assert torch.count_nonzero(fit.correction.bias) == 0
    grid = torch.linspace(0.8, 1.6, 801, dtype=torch.float64)
    grid_kl = torch.stack([kl_to_clean(clean, served, float(t)).mean() for t in grid])
    assert fit.fit_kl <= float(grid_kl.min()) + 1e-7
    assert fit.correction.temperature == pytest.approx(float(grid[grid_kl.argmin()]), abs=2e-3)


def test_the_best_temperature_with_a_bias_held_fixed_is_the_grid_minimum(
    shift: torch.Tensor,
) -> None:
    clean, served = _pair(100, 13, shift, 1.0)
    rows = PairedRows.from_logits(clean, served, 0)
    bias = -0.5 * shift.float()  # half the systematic part removed: some T still helps
    temperature = best_temperature(rows, bias)
    grid = torch.linspace(0.8, 2.0, 1201, dtype=torch.float64)
    grid_kl = torch.stack(
        [kl_to_clean(clean, served + bias.double(), float(t)).mean() for t in grid]
    )
    assert temperature == pytest.approx(float(grid[grid_kl.argmin()]), abs=2e-3)
    assert best_temperature(rows, bias, TemperatureBounds(0.5, 1.0)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="zero rows"):
        best_temperature(rows.select(torch.zeros(len(rows), dtype=torch.bool)), bias)


def test_the_temperature_stays_in_its_bounds() -> None:
    clean, served = _pair(100, 12, None, 2.0)  # heavy noise: the free optimum is T > 1.2
    rows = PairedRows.from_logits(clean, served, 0)
    free = fit_bias_at_penalty(rows, 1e-2)
    bounded = fit_bias_at_penalty(rows, 1e-2, bounds=TemperatureBounds(0.5, 1.2))
    assert free.correction.temperature > 1.2
    assert bounded.correction.temperature == pytest.approx(1.2)
    assert bounded.fit_kl >= free.fit_kl


def test_bad_arguments_are_refused() -> None:
    rows = _rows(10, 13, None)
    with pytest.raises(ValueError, match="penalty must be > 0"):
        fit_bias_at_penalty(rows, 0.0)
    with pytest.raises(ValueError, match="zero rows"):
        fit_bias_at_penalty(rows.select(torch.zeros(10, dtype=torch.bool)), 1.0)
    with pytest.raises(ValueError, match="penalties"):
        fit_logit_bias(rows, rows, penalties=[])


def _head_pair(rows: int, seed: int, head: torch.Tensor, drift: torch.Tensor) -> PairedRows:
    """Logits of an output head [V, d]: clean = W h, served = W (h + drift + fresh noise), so
    the served drift lies in the head's span (what a perturbed body does to a clean head)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, head.shape[1], generator=generator, dtype=torch.float64) * 2
    noise = 0.2 * torch.randn(rows, head.shape[1], generator=generator, dtype=torch.float64)
    return PairedRows.from_logits(
        hidden @ head.T, (hidden + drift + noise) @ head.T, torch.arange(rows) // 8
    )


def test_a_drift_in_the_heads_span_is_learnt_from_few_rows() -> None:
    generator = torch.Generator().manual_seed(11)
    head = torch.randn(VOCAB, 6, generator=generator, dtype=torch.float64)
    drift = 0.8 * torch.randn(6, generator=generator, dtype=torch.float64)
    train, validation, test = (
        _head_pair(n, s, head, drift) for n, s in ((16, 1), (16, 2), (400, 3))
    )
    spanned = fit_logit_bias(train, validation, basis=head)
    per_token = fit_logit_bias(train, validation)
    assert math.isfinite(spanned.chosen.head_penalty)
    assert spanned.head_validation_kl  # the head-span path was walked
    assert spanned.chosen.head is not None
    assert spanned.chosen.head.shape == (6,)
    kl_one = float(evaluate_bias(test, LogitBias.identity(VOCAB)).kl.mean())
    kl_spanned = float(evaluate_bias(test, spanned.chosen.correction).kl.mean())
    kl_per_token = float(evaluate_bias(test, per_token.chosen.correction).kl.mean())
    assert kl_spanned < 0.7 * kl_per_token < kl_one  # 6 numbers are learnt from 16 rows; 300 not


def test_a_head_only_fit_names_the_per_token_penalty_to_refine_with() -> None:
    generator = torch.Generator().manual_seed(12)
    head = torch.randn(VOCAB, 4, generator=generator, dtype=torch.float64)
    drift = torch.randn(4, generator=generator, dtype=torch.float64)
    train, validation = (_head_pair(n, s, head, drift) for n, s in ((40, 4), (40, 5)))
    path = fit_logit_bias(train, validation, basis=head)
    assert path.chosen.has_bias
    finite = {p: kl for p, kl in path.validation_kl.items() if math.isfinite(p)}
    if math.isfinite(path.chosen.penalty):
        assert path.refine_penalty == path.chosen.penalty
    else:
        assert path.refine_penalty == min(finite, key=finite.__getitem__)


def test_a_basis_of_another_vocabulary_is_refused() -> None:
    rows = _rows(10, 13, None)
    with pytest.raises(ValueError, match="basis has 299 rows"):
        fit_bias_at_penalty(rows, 1.0, basis=torch.zeros(VOCAB - 1, 3), head_penalty=1.0)


def test_a_fit_given_a_basis_but_no_head_part_has_no_head(shift: torch.Tensor) -> None:
    """A basis with no head-span part to fit or keep (head_penalty inf, a start without one: as
    the serving refit of a per-token or T-only choice) adds nothing: `head` is None."""
    rows = _rows(40, 14, shift)
    basis = torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(15))
    per_token = fit_bias_at_penalty(rows, 1e-3)
    refit = fit_bias_at_penalty(rows, 1e-3, basis=basis, start=per_token)
    assert refit.head is None
    assert not math.isfinite(refit.head_penalty)
    t_only = fit_bias_at_penalty(rows, math.inf, basis=basis, fit_bias=False)
    assert t_only.head is None
    assert not t_only.has_bias
