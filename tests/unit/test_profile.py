"""Profiles: round trip, policies, and clear failures for corrupt or mismatched files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from profile_helpers import CLEAN, SERVED, sample_bias, sample_profile

from noisy_temp_server.calibration.profile import (
    ModelIdentity,
    Profile,
    ProfileError,
)
from noisy_temp_server.checkpoints.perturbation import QuantizationSpec, RuntimeLogitNoiseSpec
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule


def test_round_trip(tmp_path: Path) -> None:
    profile = sample_profile()
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == profile
    assert isinstance(loaded.perturbation, QuantizationSpec)


def test_to_policy_carries_every_parameter() -> None:
    policy = sample_profile().to_policy()
    assert policy.rule is Rule.CALIBRATED
    assert policy.calibrated.temperatures == (((1.2, 1.3), (1.25, 1.35)), ((0.9, 1.0), (1.0, 1.1)))
    assert policy.calibrated.entropy_edges == (0.0, 1.5)
    assert policy.calibrated.request_temperature_edges == (0.0, 0.85)
    linear = sample_profile().to_policy("linear", version=3)
    assert (linear.rule, linear.version, linear.alpha_by_step) == (Rule.LINEAR, 3, (0.1, 0.2))
    assert TemperaturePolicy.from_json(linear.to_json()) == linear


def test_a_recommended_bias_is_served_with_its_t_at_each_request_temperature() -> None:
    profile = sample_profile()
    request_temperatures = profile.settings.request_temperatures
    bias = sample_bias(profile, "ab" * 32, 8, temperature=1.1)
    # written before the bands: its one T at every request temperature
    policy = profile.model_copy(update={"bias": bias}).to_policy()
    assert (policy.rule, policy.fixed_temperature, policy.bias) == (Rule.FIXED, 1.1, "ab" * 32)
    bands = tuple(1.1 + 0.5 * (1.0 - t) for t in request_temperatures)
    banded = profile.model_copy(
        update={"bias": bias.model_copy(update={"band_temperatures": bands})}
    ).to_policy(version=4)
    assert (banded.rule, banded.bias, banded.version) == (Rule.CALIBRATED, "ab" * 32, 4)
    assert banded.calibrated == CalibratedTable.by_request_temperature(request_temperatures, bands)
    assert banded.fixed_temperature == 1.1  # nts_rule=fixed: the bias with its own T
    assert len(request_temperatures) > 1
    document = profile.model_copy(
        update={"bias": bias.model_copy(update={"band_temperatures": bands[1:]})}
    ).model_dump(mode="json")
    with pytest.raises(ValueError, match="bias temperatures for"):
        Profile.model_validate(document)


def _written_by_an_earlier_version(path: Path, rank: int, head_map: str | None) -> Profile:
    """A profile with a bias saved to `path` with the head-map fields earlier versions wrote
    (the settings' rank; the bias's hash, rank and penalty, null without a map)."""
    profile = sample_profile()
    profile = profile.model_copy(update={"bias": sample_bias(profile, "ab" * 32, 8)})
    document = profile.model_dump(mode="json")
    document["settings"]["head_map_rank"] = rank
    document["bias"].update(
        head_map=head_map,
        head_map_rank=rank or None,
        head_map_penalty=None if head_map is None else 3.2,
    )
    path.write_text(json.dumps(document))
    return profile


def test_an_earlier_profile_without_a_head_map_loads_as_it_was(tmp_path: Path) -> None:
    profile = _written_by_an_earlier_version(tmp_path / "p.json", 0, None)
    assert Profile.load(tmp_path / "p.json") == profile


def test_a_profile_with_a_head_map_is_refused_with_one_line_saying_why(tmp_path: Path) -> None:
    """Head maps were removed: its bias was fitted on mapped rows and cannot be served alone."""
    _written_by_an_earlier_version(tmp_path / "p.json", 4, "cd" * 32)
    with pytest.raises(ProfileError, match="head map under its bias") as refused:
        Profile.load(tmp_path / "p.json")
    message = str(refused.value)
    assert "no longer serves" in message
    assert "recalibrate" in message
    assert "\n" not in message


def test_mismatched_pair_names_the_model(tmp_path: Path) -> None:
    sample_profile().save(tmp_path / "p.json")
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
    sample_profile().model_copy(update={"served": recorded}).save(tmp_path / "p.json")
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
    sample_profile().model_copy(update={"served": recorded}).save(tmp_path / "p.json")
    with pytest.raises(ProfileError, match=rf"p\.json: .*served model .*{message}"):
        Profile.load_for_pair(tmp_path / "p.json", CLEAN, actual)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: json.dumps({**d, "schema_version": 1}), "schema_version 1"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "schema_version"}), "None"),
        (lambda d: json.dumps({**d, "recommended_rule": "bogus"}), "failed validation"),
        (lambda d: json.dumps({**d, "clean": {"name": "x"}}), "failed validation"),
        (lambda d: json.dumps([1, 2]), "schema_version None"),
    ],
)
def test_corrupt_profiles_fail_clearly(tmp_path: Path, mutate: object, message: str) -> None:
    document = json.loads(sample_profile().model_dump_json())
    (tmp_path / "p.json").write_text(mutate(document))  # type: ignore[operator]
    with pytest.raises(ProfileError, match=message):
        Profile.load(tmp_path / "p.json")


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        (
            "parameters",
            "fixed_temperature",
            math.nan,
            "'fixed_temperature' must be a finite number",
        ),
        ("parameters", "t_min", 0, "t_min must satisfy 0 < t_min"),
        ("parameters", "calibrated_temperatures", [[[1.0]]], "'calibrated.temperatures' must be"),
        ("parameters", "alpha_by_step", [0.1], "'alpha_by_step' must be"),
        ("settings", "t_max", 0.5, "t_max must satisfy"),
        ("settings", "step_edges", [4, 0], "'step_edges' must be"),
    ],
)
def test_invalid_parameters_are_refused_at_load_naming_file_and_field(
    tmp_path: Path, section: str, field: str, value: object, message: str
) -> None:
    path = tmp_path / "p.json"
    sample_profile().save(path)
    document = json.loads(path.read_text())
    document[section][field] = value
    path.write_text(json.dumps(document))  # NaN is written as the bare NaN that json reads back
    with pytest.raises(ProfileError, match=message) as raised:
        Profile.load(path)
    assert str(path) in str(raised.value)
    assert "recreate it" in str(raised.value)


def test_missing_file_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "absent.json")
