"""Profiles: round trip, policies, and clear failures for corrupt or mismatched files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noisy_temp_server.estimation.profile import (
    CalibrationSettings,
    ModelIdentity,
    Profile,
    ProfileError,
    QualityRow,
    QualityTable,
    RuleParameters,
    StepBucketNoise,
)
from noisy_temp_server.pairs.perturb import QuantizationSpec, RuntimeLogitNoiseSpec
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

CLEAN = ModelIdentity(name="clean", weights_sha256="a" * 64)
SERVED = ModelIdentity(name="served", weights_sha256="b" * 64)


def _profile() -> Profile:
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
    return Profile(
        clean=CLEAN,
        served=SERVED,
        perturbation=QuantizationSpec(format="int4", group_size=64),
        settings=CalibrationSettings(prompts=10),
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
            calibrated_temperatures=((0.9, 1.0), (1.0, 1.1)),
        ),
        recommended_rule=Rule.CALIBRATED,
        quality=QualityTable(
            positions=300, sequences=10, same_top_rate=0.9, same_top_stderr=0.01, rows=(row,)
        ),
    )


def test_round_trip(tmp_path: Path) -> None:
    profile = _profile()
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == profile
    assert isinstance(loaded.perturbation, QuantizationSpec)


def test_to_policy_carries_every_parameter() -> None:
    policy = _profile().to_policy()
    assert policy.rule is Rule.CALIBRATED
    assert policy.calibrated.temperatures == ((0.9, 1.0), (1.0, 1.1))
    assert policy.calibrated.entropy_edges == (0.0, 1.5)
    linear = _profile().to_policy("linear", version=3)
    assert (linear.rule, linear.version, linear.alpha_by_step) == (Rule.LINEAR, 3, (0.1, 0.2))
    assert TemperaturePolicy.from_json(linear.to_json()) == linear


def test_mismatched_pair_names_the_model(tmp_path: Path) -> None:
    _profile().save(tmp_path / "p.json")
    other = ModelIdentity(name="other", weights_sha256="c" * 64)
    assert Profile.load_for_pair(tmp_path / "p.json", CLEAN, SERVED).served == SERVED
    with pytest.raises(ProfileError, match=r"served model served .*served model is other"):
        Profile.load_for_pair(tmp_path / "p.json", CLEAN, other)
    with pytest.raises(ProfileError, match="clean model clean"):
        Profile.load_for_pair(tmp_path / "p.json", other, SERVED)


INT4 = QuantizationSpec(format="int4", group_size=64)
WRITTEN_INT4 = ModelIdentity(
    name="written", weights_sha256="d" * 64, clean_weights_sha256="a" * 64, perturbation=INT4
)


@pytest.mark.parametrize(
    ("recorded", "actual"),
    [
        (ModelIdentity.perturbed(CLEAN, INT4), WRITTEN_INT4),
        (WRITTEN_INT4, ModelIdentity.perturbed(CLEAN, INT4)),
        (WRITTEN_INT4, WRITTEN_INT4.model_copy(update={"name": "copied"})),
    ],
    ids=["in-memory profile, written model", "written profile, in-memory model", "same weights"],
)
def test_same_perturbation_of_the_same_clean_model_is_the_same_served_model(
    tmp_path: Path, recorded: ModelIdentity, actual: ModelIdentity
) -> None:
    _profile().model_copy(update={"served": recorded}).save(tmp_path / "p.json")
    assert Profile.load_for_pair(tmp_path / "p.json", CLEAN, actual).served == recorded


@pytest.mark.parametrize(
    ("recorded", "actual", "message"),
    [
        (
            ModelIdentity.perturbed(CLEAN, INT4),
            WRITTEN_INT4.model_copy(
                update={"perturbation": INT4.model_copy(update={"group_size": 32})}
            ),
            r"int4 RTN \(group 64\) of clean .* model is written .*int4 RTN \(group 32\)",
        ),
        (
            ModelIdentity.perturbed(CLEAN, INT4),
            WRITTEN_INT4.model_copy(update={"clean_weights_sha256": "e" * 64}),
            r"of clean weights sha256 aaaaaaaaaaaa.*of clean weights sha256 eeeeeeeeeeee",
        ),
        (ModelIdentity.perturbed(CLEAN, INT4), CLEAN, r"\(weights only in memory; int4"),
        (
            ModelIdentity.perturbed(CLEAN, RuntimeLogitNoiseSpec(sigma=1.0)),
            CLEAN,
            r"runtime logit noise sigma=1 of clean.*the served model is clean \(weights sha256",
        ),
    ],
    ids=["other spec", "other clean model", "clean model served", "runtime noise missing"],
)
def test_another_served_model_is_refused_with_both_identities(
    tmp_path: Path, recorded: ModelIdentity, actual: ModelIdentity, message: str
) -> None:
    _profile().model_copy(update={"served": recorded}).save(tmp_path / "p.json")
    with pytest.raises(ProfileError, match=rf"p\.json: .*served model .*{message}"):
        Profile.load_for_pair(tmp_path / "p.json", CLEAN, actual)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: json.dumps({**d, "schema_version": 2}), "schema_version 2"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "schema_version"}), "None"),
        (lambda d: json.dumps({**d, "recommended_rule": "bogus"}), "failed validation"),
        (lambda d: json.dumps({**d, "clean": {"name": "x"}}), "failed validation"),
        (lambda d: json.dumps([1, 2]), "schema_version None"),
    ],
)
def test_corrupt_profiles_fail_clearly(tmp_path: Path, mutate: object, message: str) -> None:
    document = json.loads(_profile().model_dump_json())
    (tmp_path / "p.json").write_text(mutate(document))  # type: ignore[operator]
    with pytest.raises(ProfileError, match=message):
        Profile.load(tmp_path / "p.json")


def test_missing_file_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "absent.json")
