"""A small valid profile for the profile, policy command and online estimator tests."""

from __future__ import annotations

from typing import Any

from noisy_temp_server.adapter.lora import LoraAdapter, adapter_sha256
from noisy_temp_server.calibration.profile import (
    AdapterSummary,
    BiasSummary,
    ModelIdentity,
    Profile,
    QualityRow,
    QualityTable,
    RuleParameters,
    StepBucketNoise,
)
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec
from noisy_temp_server.temperature.rules import Rule

__all__ = ["CLEAN", "SERVED", "sample_adapter", "sample_bias", "sample_profile"]

CLEAN = ModelIdentity(name="clean", weights_sha256="a" * 64)
SERVED = ModelIdentity(name="served", weights_sha256="b" * 64)


def sample_profile(recommended_rule: Rule = Rule.CALIBRATED) -> Profile:
    """Two step buckets (edges 0, 4), a 2 x 2 calibrated table, int4 quantisation."""
    row = QualityRow(
        name="T=1",
        mean_kl=0.1,
        stderr=0.01,
        gain=0.0,
        gain_stderr=0.0,
        p50=0.05,
        p90=0.2,
        p99=0.5,
        closure=0.0,
        mean_temperature=1.0,
    )
    test = QualityTable(
        split="test",
        request_temperatures=(0.7, 1.0),
        positions=280,
        sequences=10,
        same_top_rate=0.9,
        same_top_stderr=0.01,
        rows=(row,),
    )
    return Profile(
        clean=CLEAN,
        served=SERVED,
        perturbation=QuantizationSpec(format="int4", group_size=64),
        settings=CalibrationSettings(prompts=10, request_temperatures=(0.7, 1.0)),
        noise_by_step=(
            StepBucketNoise(step_start=0, step_stop=4, positions=10, alpha=0.1, sigma2=1, tau2=10),
            StepBucketNoise(
                step_start=4, step_stop=None, positions=20, alpha=0.2, sigma2=2, tau2=10
            ),
        ),
        parameters=RuleParameters(
            t_min=0.25,
            t_max=4.0,
            fixed_temperature=0.9,
            step_edges=(0, 4),
            alpha_by_step=(0.1, 0.2),
            sigma2_by_step=(1.0, 2.0),
            fisher_var_floor=0.3,
            schedule_t_max=1.2,
            schedule_beta=0.01,
            calibrated_step_edges=(0, 4),
            calibrated_entropy_edges=(0.0, 1.5),
            calibrated_request_temperature_edges=(0.0, 0.85),
            calibrated_temperatures=(((1.2, 1.3), (1.25, 1.35)), ((0.9, 1.0), (1.0, 1.1))),
        ),
        recommended_rule=recommended_rule,
        validation_quality=QualityTable(
            split="validation",
            request_temperatures=(0.7, 1.0),
            positions=300,
            sequences=10,
            same_top_rate=0.9,
            same_top_stderr=0.01,
            rows=(row,),
        ),
        test_quality=test,
        test_quality_by_request_temperature=(
            test.model_copy(update={"request_temperatures": (0.7,), "positions": 140}),
            test.model_copy(update={"request_temperatures": (1.0,), "positions": 140}),
        ),
    )


def sample_bias(profile: Profile, sha256: str, vocab_size: int, **fields: Any) -> BiasSummary:
    """A recommended bias for `profile` (its first validation row as both quality rows), T 1
    and penalty 1e-3 unless `fields` say otherwise."""
    row = profile.validation_quality.rows[0]
    defaults: dict[str, Any] = {
        "temperature": 1.0,
        "penalty": 1e-3,
        "recommended": True,
        "validation": row,
        "test": row,
        "validation_same_top_rate": 0.9,
        "test_same_top_rate": 0.9,
    }
    return BiasSummary(sha256=sha256, vocab_size=vocab_size, **{**defaults, **fields})


def sample_adapter(profile: Profile, adapter: LoraAdapter, **fields: Any) -> AdapterSummary:
    """A recommended EoRA adapter summary of `adapter` for `profile` (its first validation row
    as both quality rows) unless `fields` say otherwise."""
    row = profile.validation_quality.rows[0]
    defaults: dict[str, Any] = {
        "sha256": adapter_sha256(adapter),
        "rank": adapter.rank,
        "target_modules": tuple(adapter.target_modules),
        "layers": len(adapter.layers),
        "method": "eora",
        "ridge": 1e-2,
        "recommended": True,
        "validation": row,
        "test": row,
    }
    return AdapterSummary(**{**defaults, **fields})
