"""Calibration: generate with the served model, score the pair, fit every rule, measure it.

The pipeline (`calibrate`):

1. the served model samples a completion for every prompt at T = 1, as it would serve it
   (with its runtime logit noise, if the pair has one; `scoring.sampling`);
2. the pair scorer turns prompt + completion into per-position records (`scoring.scorer`), each
   position measured at every request temperature of the settings (KL to softmax(z/T_r));
3. prompts (not positions) are split three ways: fit, validation and test
   (`split_fit_validation_test`), and the validation prompts in two halves, selection and
   gate (`split_selection_gate`): every choice made from data is made on the selection half
   and judged on the gate half, never on the rows it was chosen on;
4. every rule is fitted on the fit split (`calibration.fitting.fit_rules`); the calibrated
   table has one band per request temperature, each starting from its best constant where
   the bands' constants jointly beat T = 1 on the selection half and the band's own
   selection positions do not show its constant worse than 1 (else from 1), and departs from
   it only where the selection half shows a material gain (`is_material_gain`);
5. quality tables compare T = 1, every rule, calibrated and the oracle on the gate half (the
   profile's `validation_quality`) and on the test split (`calibration.quality.quality_table`),
   pooled over the request temperatures, and on the test split at each request temperature;
6. the recommended rule (`recommend_rule`) is chosen on the gate half's table: the lowest-KL
   rule whose paired gain over T = 1 is material (mean minus 2 cluster-robust standard
   errors > 0, and above 0.1 % of KL(T = 1)), else `off`: no rule is served on the strength
   of noise. The test table, on prompts that took part in neither fitting nor choosing,
   reports it;
7. the per-token logit bias + T (`calibration.bias_fit.calibrate_bias`) is fitted on the full
   rows of the fit split's positions (up to `bias_rows` positions in all), first in the span
   of the clean model's output head, then per token on top, its penalties chosen on the
   selection half, and measured on the gate half and the test split; it is recommended only
   where its gate-half gain over T = 1 is significant and it is not significantly worse than
   the recommended rule on the same gate rows at any request temperature (it replaces that
   rule when served, with a T of its own at each request temperature), and its test row is the
   figure to quote.

With `CalibrationSettings.adapter_rank` > 0 a compensation adapter is fitted first
(`calibration.adapter_calibration.calibrate_adapter`, on completions the served model samples
without it) and, where it is recommended, every step above runs on the served model with the
adapter applied: the rules and the bias correct what it leaves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from noisy_temp_server.adapter.layer_fit import adapter_targets
from noisy_temp_server.calibration.adapter_calibration import (
    AdapterCalibration,
    applied_adapter,
    calibrate_adapter,
)
from noisy_temp_server.calibration.bias_fit import BiasCalibration, calibrate_bias
from noisy_temp_server.calibration.bias_quality import ScoredSet, score_with_rows
from noisy_temp_server.calibration.completions import (
    sample_completions,
    sample_served,
    served_rows_for,
)
from noisy_temp_server.calibration.fitting import FITTED_RULES, fit_rules
from noisy_temp_server.calibration.profile import ModelIdentity, Profile
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.quality import quality_table, recommend_rule
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    split_fit_validation_test,
    split_selection_gate,
)
from noisy_temp_server.checkpoints.loading import LoadedPair
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.correction.paired_rows import PairedRows
from noisy_temp_server.scoring.engine_rows import EngineRows
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = [
    "CalibrationData",
    "CalibrationResult",
    "calibrate",
    "calibrate_records",
    "calibrate_scored",
    "calibrate_with_data",
    "score_pair",
    "score_sequences",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationResult:
    """The profile, and the records of its splits: rules were fitted on `fit`, the calibrated
    table's cells chosen on `selection`, the recommended rule gated on `gate` (the two halves
    of the validation prompts), and the reported quality measured on `test`; the bias fitted
    on the same splits, with its vector (None without rows)."""

    profile: Profile
    fit: PositionRecords
    selection: PositionRecords
    gate: PositionRecords
    test: PositionRecords
    bias: BiasCalibration | None = None
    adapter: AdapterCalibration | None = None

    @property
    def validation(self) -> PositionRecords:
        """The validation prompts' records: the selection half, then the gate half."""
        return PositionRecords.concat([self.selection, self.gate])


def _log_progress(label: str) -> Callable[[int, int], None]:
    started = time.monotonic()

    def report(done: int, total: int) -> None:
        logger.info("%s: %d/%d (%.0f s)", label, done, total, time.monotonic() - started)

    return report


def score_pair(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
) -> ScoredSet:
    """Generate with the served model and score the pair: records for every prompt, each
    position once per request temperature of `settings`, and the full rows of up to
    `settings.bias_rows` positions for the bias fit."""
    sequences, engine_rows = _sample(pair, prompts, settings)
    return score_sequences(pair, sequences, settings, device=device, engine_rows=engine_rows)


def _sample(
    pair: LoadedPair, prompts: Sequence[Prompt], settings: CalibrationSettings
) -> tuple[list[ScoringSequence], EngineRows | None]:
    """`sample_served` as `settings` say (``auto`` served rows resolved by `served_rows_for`)."""
    served_rows = served_rows_for(
        pair, settings.served_rows, with_adapter=settings.adapter_rank > 0
    )
    return sample_served(
        pair,
        prompts,
        served_rows,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        progress=_log_progress(f"generating ({served_rows} rows)"),
    )


def score_sequences(
    pair: LoadedPair,
    sequences: Sequence[ScoringSequence],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
    engine_rows: EngineRows | None = None,
) -> ScoredSet:
    """`score_pair` on completions already sampled (`sample_completions`), the served rows
    from `engine_rows` when given (else the served model's forward)."""
    scorer = PairScorer(
        pair.clean_model,
        pair.served_model if engine_rows is None else engine_rows,
        runtime_noise=pair.runtime_noise,
        device=device,
    )
    return score_with_rows(
        scorer,
        sequences,
        request_temperatures=settings.request_temperatures,
        max_rows=settings.bias_rows,
        progress=_log_progress("scoring"),
    )


def calibrate_records(
    records: PositionRecords,
    pair_identity: tuple[ModelIdentity, ModelIdentity],
    perturbation: PerturbationSpec | None,
    settings: CalibrationSettings,
    rows: PairedRows | None = None,
    *,
    row_records: PositionRecords | None = None,
    basis: torch.Tensor | None = None,
) -> CalibrationResult:
    """Split `records` by prompt into fit / validation / test and the validation prompts into
    selection / gate halves; fit every rule on fit, choose the calibrated table's cells on the
    selection half, the recommended rule on the gate half (`recommend_rule`), report on test.
    With `rows` (of some of the same positions) the per-token bias is fitted and measured on
    the same splits (`calibrate_bias`, with the clean output head's `basis` if given), and,
    given `row_records` (the records at request temperature 1 of the positions of `rows`, row
    for row: `ScoredSet.row_records`), recommended only if not significantly worse than the
    recommended rule on the same gate rows.

    Raises `InsufficientDataError` when a split is too small to fit or report on.
    """
    fit_mask, validation_mask, test_mask = split_fit_validation_test(
        records.sequence_id, settings.validation_fraction, settings.test_fraction, settings.seed
    )
    fit, validation, test = (records.select(m) for m in (fit_mask, validation_mask, test_mask))
    selection_mask, gate_mask = split_selection_gate(validation.sequence_id, settings.seed)
    selection, gate = validation.select(selection_mask), validation.select(gate_mask)
    parameters, noise = fit_rules(fit, settings, validation=selection)
    policies = [parameters.to_policy(rule) for rule in FITTED_RULES]
    minimum = settings.min_quality_positions
    validation_quality = quality_table(gate, policies, minimum, split="validation")
    test_quality = quality_table(test, policies, minimum, split="test")
    by_request_temperature = tuple(
        quality_table(test.select(test.request_temperature == t), policies, minimum, split="test")
        for t in settings.request_temperatures
    )
    recommended_rule = recommend_rule(validation_quality)
    bias = (
        calibrate_bias(
            rows,
            settings,
            basis,
            rule=parameters.to_policy(recommended_rule),
            row_records=row_records,
        )
        if rows is not None and len(rows)
        else None
    )
    profile = Profile(
        clean=pair_identity[0],
        served=pair_identity[1],
        perturbation=perturbation,
        settings=settings,
        noise_by_step=tuple(noise),
        parameters=parameters,
        recommended_rule=recommended_rule,
        validation_quality=validation_quality,
        test_quality=test_quality,
        test_quality_by_request_temperature=by_request_temperature,
        bias=None if bias is None else bias.summary(),
    )
    return CalibrationResult(
        profile=profile, fit=fit, selection=selection, gate=gate, test=test, bias=bias
    )


def calibrate(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
) -> CalibrationResult:
    """The whole pipeline of the module docstring on one pair. ValueError before any scoring
    when the prompts are not the settings' count."""
    return calibrate_with_data(pair, prompts, settings, device=device).result


@dataclass(frozen=True)
class CalibrationData:
    """`calibrate`'s result with what it was computed from: the completions sampled as
    served (with the adapter where it is recommended) and their scores."""

    result: CalibrationResult
    sequences: list[ScoringSequence]
    scored: ScoredSet


def calibrate_with_data(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
) -> CalibrationData:
    """`calibrate`, keeping the sequences and scores (what a benchmark measures further on);
    the settings' ``auto`` served rows are resolved first (`served_rows_for`) and recorded."""
    if len(prompts) != settings.prompts:
        raise ValueError(f"settings say {settings.prompts} prompts, got {len(prompts)}")
    served_rows = served_rows_for(
        pair, settings.served_rows, with_adapter=settings.adapter_rank > 0
    )
    settings = settings.model_copy(update={"served_rows": served_rows})
    adapter = _calibrate_adapter(pair, prompts, settings, device) if settings.adapter_rank else None
    served = adapter.adapter if adapter is not None and adapter.summary.recommended else None
    with applied_adapter(pair.served_model, served):
        sequences, engine_rows = _sample(pair, prompts, settings)
        scored = score_sequences(pair, sequences, settings, device=device, engine_rows=engine_rows)
        logger.info("scored %d positions in %d sequences", len(scored.records), len(prompts))
        result = calibrate_scored(pair, scored, settings)
    if adapter is not None:
        result = replace(
            result,
            profile=result.profile.model_copy(update={"adapter": adapter.summary}),
            adapter=adapter,
        )
    return CalibrationData(result, sequences, scored)


def _calibrate_adapter(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    device: str | torch.device,
) -> AdapterCalibration:
    """The adapter of `settings.adapter_rank`, fitted on completions sampled without it.
    ValueError, before any sampling, for a pair whose served weights are the clean ones or a
    rank no perturbed layer can take (`adapter_targets`)."""
    if pair.served_model is pair.clean_model:
        raise ValueError(
            "--adapter-rank needs a pair whose served weights differ from the clean ones; this "
            "pair serves the clean weights (runtime logit noise): there is no weight error for "
            "an adapter to correct"
        )
    adapter_targets(pair.clean_model, pair.served_model, settings.adapter_rank)
    sequences = sample_completions(
        pair,
        prompts,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        progress=_log_progress("generating for the adapter"),
    )
    started = time.monotonic()
    adapter = calibrate_adapter(pair, prompts, sequences, settings, device=device)
    logger.info("adapter calibrated in %.0f s", time.monotonic() - started)
    return adapter


def calibrate_scored(
    pair: LoadedPair, scored: ScoredSet, settings: CalibrationSettings
) -> CalibrationResult:
    """`calibrate_records` on what `score_pair` scored of `pair` (its records, rows and row
    records, the clean output head as the bias's basis when it fits)."""
    return calibrate_records(
        scored.records,
        (pair.clean, pair.served),
        pair.perturbation,
        settings,
        scored.rows,
        row_records=scored.row_records,
        basis=pair.head_basis(scored.rows.vocab_size),
    )
