"""The bias on scored pairs: rows beside the records, the penalty chosen on validation
prompts, and its held-out quality row beside T = 1 and the oracle."""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import pytest
import torch
from profile_helpers import CLEAN, SERVED
from safetensors.torch import save_file

from noisy_temp_server.calibration.bias_fit import calibrate_bias, fit_band_temperatures
from noisy_temp_server.calibration.bias_quality import (
    BIAS_ROW_NAME,
    bias_quality,
    kl_at_temperatures,
    score_with_rows,
)
from noisy_temp_server.calibration.fitting import rule_temperatures
from noisy_temp_server.calibration.pipeline import calibrate_records
from noisy_temp_server.calibration.profile import Profile
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    InsufficientDataError,
    is_not_worse,
    is_significant,
    split_fit_validation_test,
)
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.perturbation import (
    QuantizationSpec,
    apply_perturbation,
    output_head,
)
from noisy_temp_server.correction.bias import fit_logit_bias
from noisy_temp_server.correction.files import (
    bias_file_name,
    bias_sha256,
    load_bias_file,
    save_bias_file,
)
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows, evaluate_bias
from noisy_temp_server.correction.request_bands import at_request_temperature
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.rules import Rule


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model and its int4 copy (body and head quantised alike: the default target
    leaves the output head clean)."""
    clean, _ = load_causal_lm(tiny_model_dir)
    served = copy.deepcopy(clean)
    apply_perturbation(served, QuantizationSpec(format="int4", group_size=32))
    return clean, served


@pytest.fixture(scope="module")
def scorer(models: tuple[torch.nn.Module, torch.nn.Module]) -> PairScorer:
    return PairScorer(*models, chunk_positions=16)


def _sequences(count: int) -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(0)
    return [
        ScoringSequence(torch.randint(3, 500, (40,), generator=generator).tolist(), 8, i)
        for i in range(count)
    ]


def test_rows_are_scored_beside_the_records_of_the_same_positions(scorer: PairScorer) -> None:
    sequences = _sequences(3)
    scored = score_with_rows(scorer, sequences)
    expected = scorer.score(sequences)
    assert len(scored.records) == len(expected) == len(scored.rows) == 3 * 32
    torch.testing.assert_close(scored.records.kl_at_one, expected.kl_at_one)
    kl_one = bias_quality(scored.rows, LogitBias.identity(scored.rows.vocab_size), 1).t_one
    assert kl_one.mean_kl == pytest.approx(float(expected.kl_at_one.double().mean()), rel=1e-5)


def test_max_rows_keeps_an_even_share_of_every_sequence(scorer: PairScorer) -> None:
    scored = score_with_rows(scorer, _sequences(3), max_rows=40, request_temperatures=(0.5, 1.0))
    assert len(scored.records) == 2 * 96
    assert len(scored.rows) <= 40
    assert torch.unique(scored.rows.sequence_id).tolist() == [0, 1, 2]
    # the rows' own records at request temperature 1, row for row: a rule's T there, exactly
    rows, row_records = scored.rows, scored.row_records
    assert len(row_records) == len(rows)
    assert torch.equal(row_records.sequence_id, rows.sequence_id)
    assert (row_records.request_temperature == 1.0).all()
    assert (row_records.step % (row_records.step[1] - row_records.step[0]) == 0).all()
    ones = torch.ones(len(rows))
    torch.testing.assert_close(
        kl_at_temperatures(rows, ones), row_records.kl_at_one.double(), rtol=1e-4, atol=1e-6
    )
    t = torch.linspace(0.5, 2.0, len(rows))
    zero = torch.zeros(rows.vocab_size)
    by_row = torch.cat(
        [
            evaluate_bias(rows.select(torch.tensor([i])), LogitBias(zero, float(t[i]))).kl
            for i in range(len(rows))
        ]
    )
    torch.testing.assert_close(kl_at_temperatures(rows, t), by_row.double(), rtol=1e-4, atol=1e-6)


def test_max_rows_zero_keeps_no_rows(scorer: PairScorer) -> None:
    scored = score_with_rows(scorer, _sequences(2), max_rows=0)
    assert len(scored.records) == 2 * 32
    assert len(scored.rows) == len(scored.row_records) == 0


def test_the_held_out_quality_row_is_paired_with_t_one_and_the_oracle(scorer: PairScorer) -> None:
    scored = score_with_rows(scorer, _sequences(12))
    fit_mask = scored.rows.sequence_id < 8
    path = fit_logit_bias(
        scored.rows.select(fit_mask & (scored.rows.sequence_id % 2 == 0)),
        scored.rows.select(fit_mask & (scored.rows.sequence_id % 2 == 1)),
        penalties=(1e-1, 1e-2, 1e-3),
    )
    quality = bias_quality(scored.rows.select(~fit_mask), path.chosen.correction)
    assert quality.row.name == BIAS_ROW_NAME
    assert quality.sequences == 4
    assert quality.t_one.gain == 0.0
    assert quality.oracle.mean_kl <= quality.t_one.mean_kl
    assert quality.row.gain == pytest.approx(quality.t_one.mean_kl - quality.row.mean_kl)
    assert quality.share_removed == pytest.approx(quality.row.gain / quality.t_one.mean_kl)
    assert quality.row.mean_temperature == path.chosen.correction.temperature
    assert math.inf in path.validation_kl  # the T-only fit competed


def test_too_few_held_out_rows_are_refused(scorer: PairScorer) -> None:
    scored = score_with_rows(scorer, _sequences(1))
    with pytest.raises(InsufficientDataError, match="at least 100"):
        bias_quality(scored.rows, LogitBias.identity(scored.rows.vocab_size))
    with pytest.raises(InsufficientDataError):
        calibrate_bias(scored.rows, CalibrationSettings(prompts=2))


def test_calibration_fits_the_bias_on_the_rules_splits(scorer: PairScorer, tmp_path: Path) -> None:
    scored = score_with_rows(scorer, _sequences(12), max_rows=300)
    settings = CalibrationSettings(
        prompts=12,
        max_new_tokens=32,
        request_temperatures=(1.0,),
        min_cell_positions=10,
        min_quality_positions=30,
    )
    result = calibrate_records(
        scored.records,
        (CLEAN, SERVED),
        None,
        settings,
        scored.rows,
        row_records=scored.row_records,
    )
    assert result.bias is not None
    summary = result.profile.bias
    assert summary is not None
    _, validation, test = split_fit_validation_test(
        scored.rows.sequence_id, settings.validation_fraction, settings.test_fraction, 0
    )
    assert set(scored.rows.sequence_id[test].tolist()) == set(result.test.sequence_id.tolist())
    # the bias is recommended on the rows of the validation prompts' gate half, as the rules
    # are, not on the selection half its penalties were chosen on
    gate_ids = set(result.gate.sequence_id.tolist())
    gate = torch.tensor([i in gate_ids for i in scored.rows.sequence_id.tolist()])
    assert gate_ids < set(scored.rows.sequence_id[validation].tolist())
    assert result.bias.validation.positions == int(gate.sum())
    assert summary.test == result.bias.test.row
    served_on = torch.tensor([i not in set(result.test.sequence_id.tolist()) for i in range(12)])
    assert result.bias.path.chosen.fit_kl == pytest.approx(
        float(
            evaluate_bias(
                scored.rows.select(served_on[scored.rows.sequence_id]), result.bias.correction
            ).kl.mean()
        ),
        rel=1e-4,
    )  # the served bias is refitted on the fit and validation prompts
    assert summary.rule == result.profile.recommended_rule
    assert summary.gain_over_rule is not None
    assert summary.gain_over_rule_stderr is not None
    assert summary.recommended == (
        (summary.penalty is not None or summary.head_penalty is not None)
        and is_significant(summary.validation.gain, summary.validation.gain_stderr)
        and is_not_worse(summary.gain_over_rule, summary.gain_over_rule_stderr)
    )
    for recommended in (True, False):
        bias = summary.model_copy(update={"recommended": recommended})
        profile = result.profile.model_copy(update={"bias": bias})
        assert profile.to_policy(Rule.SQRT) == result.profile.parameters.to_policy(Rule.SQRT)
        policy = profile.to_policy()
        if recommended:  # the combination measured: the bias with its own T
            assert (policy.rule, policy.fixed_temperature, policy.bias) == (
                Rule.FIXED,
                summary.temperature,
                summary.sha256,
            )
        else:
            assert policy == profile.to_policy(profile.recommended_rule)
    assert "changes greedy output" in result.bias.to_markdown()
    profile_path = tmp_path / "profile.json"
    result.profile.save(profile_path)
    assert Profile.load(profile_path) == result.profile
    written = save_bias_file(tmp_path, result.bias.correction.bias)
    assert written.name == bias_file_name(summary.sha256)
    torch.testing.assert_close(
        load_bias_file(tmp_path, summary.sha256), result.bias.correction.bias
    )


def test_a_bias_file_that_does_not_match_its_hash_is_refused(tmp_path: Path) -> None:
    bias = torch.randn(50)
    written = save_bias_file(tmp_path, bias)
    save_file({"bias": bias + 1e-3}, str(written))
    with pytest.raises(ValueError, match="does not hold"):
        load_bias_file(tmp_path, bias_sha256(bias))
    with pytest.raises(ValueError, match="cannot read"):
        load_bias_file(tmp_path / "missing", bias_sha256(bias))


def test_calibration_with_the_clean_head_fits_in_its_span_first(
    scorer: PairScorer, models: tuple[torch.nn.Module, torch.nn.Module]
) -> None:
    scored = score_with_rows(scorer, _sequences(12), max_rows=300)
    basis = output_head(models[0])
    assert basis is not None
    settings = CalibrationSettings(prompts=12, max_new_tokens=32, min_quality_positions=30)
    calibration = calibrate_bias(scored.rows, settings, basis.detach())
    path, summary = calibration.path, calibration.summary()
    assert path.head_validation_kl  # the head-span path was walked before the per-token one
    head_penalty = path.chosen.head_penalty
    assert summary.head_penalty == (head_penalty if math.isfinite(head_penalty) else None)
    assert summary.penalty == path.refine_penalty


def test_the_bias_is_served_with_a_temperature_of_its_own_at_every_request_temperature() -> None:
    # Fresh noise on every logit plus a small per-token offset: at T_r = 1 the bias with its T
    # is ahead of the calibrated table (it also removes the offset); at T_r = 0.5 the table's
    # band serves a far larger T, and the bias with its T_r = 1 T falls behind there. With a T
    # of its own at T_r = 0.5 (fitted with the bias held fixed) it is ahead there too.
    generator = torch.Generator().manual_seed(1)
    offset = 0.3 * torch.randn(64, generator=generator)
    records, at_half, at_one, rows = [], [], [], []
    step = torch.arange(48)
    for sequence in range(40):
        clean = 2.5 * torch.randn(48, 64, generator=generator)
        served = clean + offset + 2.0 * torch.randn(48, 64, generator=generator)
        for t_r, kept in ((0.5, at_half), (1.0, at_one)):
            kept.append(
                PositionRecords.from_logits(
                    clean, served, step=step, sequence_id=sequence, request_temperature=t_r
                )
            )
        records += [at_half[-1], at_one[-1]]
        rows.append(PairedRows.from_logits(clean, served, sequence))
    settings = CalibrationSettings(
        prompts=40, request_temperatures=(0.5, 1.0), step_edges=(0,), entropy_buckets=1
    )
    all_rows = PairedRows.concat(rows)
    result = calibrate_records(
        PositionRecords.concat(records),
        (CLEAN, SERVED),
        None,
        settings,
        all_rows,
        row_records=PositionRecords.concat(at_one),
    )
    bias, calibration = result.profile.bias, result.bias
    assert bias is not None
    assert calibration is not None
    assert result.profile.recommended_rule is Rule.CALIBRATED
    assert bias.band_temperatures is not None
    t_half, t_one = bias.band_temperatures
    assert t_one == bias.temperature
    assert t_half > 1.3 * t_one  # fresh noise needs a larger T* at a lower T_r
    assert bias.recommended
    policy = result.profile.to_policy()
    assert (policy.rule, policy.bias) == (Rule.CALIBRATED, bias.sha256)
    assert policy.calibrated.request_temperature_edges == (0.0, 0.75)
    assert policy.calibrated.temperatures == (((t_half,),), ((t_one,),))

    rule_at_half = {
        0.5: rule_temperatures(
            result.profile.to_policy(Rule.CALIBRATED), PositionRecords.concat(at_half)
        )
    }
    correction = calibration.correction
    with_one_t = bias_quality(all_rows, correction, rule_temperatures=rule_at_half).over_rule
    with_bands = bias_quality(
        all_rows,
        correction,
        rule_temperatures=rule_at_half,
        band_temperatures=calibration.band_temperatures,
    ).over_rule
    assert with_one_t is not None
    assert with_bands is not None
    assert with_one_t[0] < -2 * with_one_t[1]  # served with its T_r = 1 T: behind the band
    assert with_bands[0] > 2 * with_bands[1]  # with its own T there: ahead


def test_a_band_temperature_is_the_best_t_of_the_biased_logits_at_its_request_temperature() -> None:
    generator = torch.Generator().manual_seed(3)
    clean = 3.0 * torch.randn(200, 40, generator=generator, dtype=torch.float64)
    offset = 0.5 * torch.randn(40, generator=generator, dtype=torch.float64)
    served = clean + offset + 1.5 * torch.randn(200, 40, generator=generator, dtype=torch.float64)
    rows = PairedRows.from_logits(clean, served, torch.arange(200) // 10)
    correction = LogitBias(-offset.float(), 1.3)
    bands = fit_band_temperatures(rows, correction, (0.5, 1.0))
    assert bands[1.0] == 1.3  # at T_r = 1: the T fitted jointly with the bias
    # independently: the exact KL(softmax(z/T_r) || softmax((z~ + b)/(T_r T))) on a grid
    target = torch.softmax(clean / 0.5, dim=-1)
    grid = torch.linspace(1.0, 3.0, 2001, dtype=torch.float64)
    kl = torch.stack(
        [
            (target * (target.log() - torch.log_softmax((served - offset) / (0.5 * t), -1)))
            .sum(-1)
            .mean()
            for t in grid
        ]
    )
    assert bands[0.5] == pytest.approx(float(grid[kl.argmin()]), abs=2e-3)
    assert bands[0.5] > 1.3  # fresh noise needs a larger T* at a lower T_r


def test_rows_at_a_request_temperature_are_those_of_the_scaled_logits() -> None:
    generator = torch.Generator().manual_seed(2)
    clean, served = torch.randn(6, 20, generator=generator), torch.randn(6, 20, generator=generator)
    clean[:, 3] = -math.inf  # a token the clean model never gives: p = 0 there
    served[:, 3] = -math.inf  # ... which the served model masks too
    rows = PairedRows.from_logits(clean, served, 3)
    for request_temperature in (0.5, 0.7, 1.2):
        expected = PairedRows.from_logits(
            clean / request_temperature, served / request_temperature, 3
        )
        at_t_r = at_request_temperature(rows, request_temperature)
        for name in ("clean_prob", "served_shifted", "served_mean", "neg_entropy"):
            # float32 rows: the same to float32 rounding
            torch.testing.assert_close(
                getattr(at_t_r, name), getattr(expected, name), rtol=1e-5, atol=1e-6
            )
        assert torch.equal(at_t_r.clean_top, expected.clean_top)
        assert torch.equal(at_t_r.sequence_id, expected.sequence_id)
    assert at_request_temperature(rows, 1.0) is rows


def test_a_bias_behind_the_recommended_rule_does_not_replace_it() -> None:
    # The served rows are 3x as sharp as the clean ones in the first 8 steps (best T 3) and
    # right after (best T 1), plus a small per-token offset. The calibrated table serves both
    # T; a bias with one T removes the offset but not the early sharpening: it beats T = 1
    # clearly, and is far behind the rule it would replace.
    generator = torch.Generator().manual_seed(0)
    offset = 0.15 * torch.randn(64, generator=generator)
    records, rows = [], []
    step = torch.arange(48)
    for sequence in range(40):
        clean = 2.5 * torch.randn(48, 64, generator=generator)
        sharpening = torch.where(step < 8, 3.0, 1.0).unsqueeze(1)
        served = clean * sharpening + offset + 0.3 * torch.randn(48, 64, generator=generator)
        records.append(PositionRecords.from_logits(clean, served, step=step, sequence_id=sequence))
        rows.append(PairedRows.from_logits(clean, served, sequence))
    settings = CalibrationSettings(
        prompts=40, request_temperatures=(1.0,), step_edges=(0, 8), entropy_buckets=1
    )
    calibrate = functools.partial(
        calibrate_records,
        PositionRecords.concat(records),
        (CLEAN, SERVED),
        None,
        settings,
        PairedRows.concat(rows),
    )
    result = calibrate(row_records=PositionRecords.concat(records))
    profile, bias = result.profile, result.profile.bias
    assert bias is not None
    assert result.bias is not None
    assert "not recommended" in result.bias.to_markdown()
    # the gain over T = 1 is met; the markdown names the condition that is not
    assert result.bias.unmet_conditions() == ["it is more than 2 s.e. behind the rule at T_r = 1"]
    assert "not met: it is more than 2 s.e. behind the rule at T_r = 1." in (
        result.bias.to_markdown()
    )
    assert "`calibrated` rule it would replace" in result.bias.to_markdown()
    assert profile.recommended_rule is Rule.CALIBRATED
    assert is_significant(bias.validation.gain, bias.validation.gain_stderr)
    assert bias.rule is Rule.CALIBRATED
    assert bias.gain_over_rule is not None
    assert bias.gain_over_rule_stderr is not None
    assert bias.gain_over_rule < -10 * bias.gain_over_rule_stderr
    assert not bias.recommended
    assert profile.to_policy() == profile.to_policy(Rule.CALIBRATED)
    unchecked = calibrate().profile.bias  # no rows' records: compared with T = 1 only
    assert unchecked is not None
    assert unchecked.recommended
