"""Online estimator: starts at T = 1, refits with evidence, bounded window, thread safety."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from profile_helpers import sample_bias, sample_profile
from spy_helpers import record_calls

from noisy_temp_server.calibration import fitting
from noisy_temp_server.calibration.profile import Profile
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import split_by_sequence
from noisy_temp_server.online.estimator import OnlineEstimator
from noisy_temp_server.online.startup import DEFAULT_PAIR_PROFILE
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.rules import Rule


def _request(request_id: int, rows: int = 40, noise: float = 2.0) -> PositionRecords:
    generator = torch.Generator().manual_seed(request_id)
    clean = torch.randn(rows, 200, generator=generator) * 2.5
    served = clean + noise * torch.randn(rows, 200, generator=generator)
    return PositionRecords.from_logits(
        clean, served, step=torch.arange(rows), sequence_id=request_id
    )


def test_serves_t_one_until_enough_evidence_then_publishes_a_new_version() -> None:
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(
        min_positions=400, refit_every=200, settings=settings, clock=lambda: 123.0
    )
    first = estimator.current_policy()
    assert first.rule is Rule.CALIBRATED
    assert estimator.reads_kl_curves  # it fits the calibrated table
    assert bool((policy_temperature(first, torch.arange(5), torch.randn(5, 10)) == 1).all())
    for request in range(9):
        estimator.add(_request(request))
    assert estimator.current_policy() is first  # 360 positions: not enough yet
    estimator.add(_request(9))
    policy = estimator.current_policy()
    assert policy.version == first.version + 1
    assert max(t for band in policy.calibrated.temperatures for row in band for t in row) > 1.2
    assert min(policy.alpha_by_step) > 0.3
    status = estimator.status()
    assert status["positions_seen"] == 400
    assert status["healthy"] is True
    assert status["last_refit_time"] == 123.0
    assert len(status["alpha_by_step"]) == len(policy.step_edges)


def _one_band(profile: Profile) -> Profile:
    """`profile` with only its T_r = 1 band (what a single-band calibration writes)."""
    parameters = profile.parameters.model_copy(
        update={
            "calibrated_request_temperature_edges": (0.0,),
            "calibrated_temperatures": profile.parameters.calibrated_temperatures[-1:],
        }
    )
    return profile.model_copy(update={"parameters": parameters})


def test_a_profile_recommending_off_learns_with_its_calibrated_table() -> None:
    profile = _one_band(sample_profile(Rule.OFF))
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(profile, settings=settings, min_positions=400, refit_every=400)
    assert estimator.current_policy() == profile.to_policy(Rule.CALIBRATED)
    for request in range(10):
        estimator.add(_request(request))
    policy = estimator.current_policy()
    assert (policy.rule, policy.version) == (Rule.CALIBRATED, 1)
    assert max(t for band in policy.calibrated.temperatures for row in band for t in row) > 1.2


def test_a_banded_profile_recommending_off_starts_at_one_and_learns_online() -> None:
    """The shipped default-pair profile without its bias, recommending `off`: its table has
    request-temperature bands, which the online refit cannot refit, so the server starts on an
    all-ones one-band table (T = 1, as the profile recommends) that the refit may move. (It
    served the banded table, pinned for good.)"""
    profile = Profile.load(DEFAULT_PAIR_PROFILE).model_copy(
        update={"recommended_rule": Rule.OFF, "bias": None}
    )
    assert len(profile.to_policy(Rule.CALIBRATED).calibrated.request_temperature_edges) > 1
    estimator = OnlineEstimator(profile, min_positions=400, refit_every=400)
    policy = estimator.current_policy()
    assert policy.rule is Rule.CALIBRATED
    assert policy.calibrated == CalibratedTable()  # T = 1 everywhere
    assert policy.alpha_by_step == profile.to_policy().alpha_by_step
    assert estimator.reads_kl_curves  # the calibrated table is refitted online


def _flattened(request_id: int, rows: int = 40) -> PositionRecords:
    """A request whose served logits are the clean ones halved: it wants T = 0.5."""
    generator = torch.Generator().manual_seed(request_id)
    clean = torch.randn(rows, 200, generator=generator) * 2.5
    return PositionRecords.from_logits(
        clean, 0.5 * clean, step=torch.arange(rows), sequence_id=request_id
    )


def test_a_refit_worse_than_one_on_held_out_requests_keeps_the_previous_value() -> None:
    """The requests the refit holds out want T = 0.5, those it fits on T > 1: the refitted
    fixed T is significantly worse than T = 1 on the held-out ones, so the previous T stays
    (alpha / sigma2 are new). (The in-sample best was published unchecked.)"""
    profile = sample_profile(Rule.FIXED)
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    fit_on, _ = split_by_sequence(torch.arange(20), settings.validation_fraction, settings.seed)
    estimator = OnlineEstimator(profile, settings=settings, min_positions=800, refit_every=800)
    for request in range(20):
        estimator.add(_request(request) if fit_on[request] else _flattened(request))
    policy, initial = estimator.current_policy(), profile.to_policy()
    assert policy.version == 1
    assert policy.fixed_temperature == initial.fixed_temperature
    assert policy.alpha_by_step != initial.alpha_by_step
    assert estimator.status()["refits_kept_previous"] == 1


def test_keeps_a_rule_the_profile_recommends() -> None:
    profile = sample_profile(Rule.FIXED)
    assert OnlineEstimator(profile).current_policy() == profile.to_policy(Rule.FIXED)


def test_refits_only_what_the_served_rule_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, fitting, ("_schedule", "_fisher_floor"))
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(settings=settings, min_positions=400, refit_every=400)
    for request in range(10):
        estimator.add(_request(request))
    assert estimator.current_policy().version == 1
    assert "_schedule" not in calls
    assert "_fisher_floor" not in calls


def test_parameters_of_other_rules_are_kept() -> None:
    profile = sample_profile(Rule.FIXED)
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(profile, settings=settings, min_positions=400, refit_every=400)
    for request in range(10):
        estimator.add(_request(request))
    policy, initial = estimator.current_policy(), profile.to_policy()
    assert (policy.rule, policy.version) == (Rule.FIXED, 1)
    assert policy.fixed_temperature > 1.2
    assert policy.step_edges == (0, 20)
    assert policy.calibrated == initial.calibrated
    assert (policy.schedule_t_max, policy.fisher_var_floor) == (
        initial.schedule_t_max,
        initial.fisher_var_floor,
    )


def test_keeps_the_rule_and_bounds_of_an_initial_policy() -> None:
    initial = TemperaturePolicy(rule=Rule.LINEAR, version=7)
    estimator = OnlineEstimator(initial, min_positions=100, refit_every=100)
    for request in range(3):
        estimator.add(_request(request))
    policy = estimator.current_policy()
    assert (policy.rule, policy.version, policy.bounds) == (Rule.LINEAR, 8, initial.bounds)


def test_window_is_bounded_to_recent_requests() -> None:
    estimator = OnlineEstimator(min_positions=100, refit_every=10_000, window_positions=100)
    for request in range(10):
        estimator.add(_request(request))
    status = estimator.status()
    assert status["positions_seen"] == 400
    assert 100 <= status["window_positions"] < 140
    assert status["window_requests"] == 3


def test_the_choices_of_one_request_count_as_one_request_in_the_window() -> None:
    estimator = OnlineEstimator(min_positions=100, refit_every=10_000)
    for request in (0, 0, 0, 1):  # three choices of request 0, one of request 1
        estimator.add(_request(request))
    assert estimator.status()["window_requests"] == 2


def test_failed_refit_keeps_policy_and_reports_unhealthy() -> None:
    estimator = OnlineEstimator(min_positions=40, refit_every=40)
    estimator.add(_request(0))  # one request: cannot split for the calibrated table
    assert estimator.current_policy().version == 0
    assert estimator.status()["healthy"] is False
    assert "failed" in estimator.status()["last_error"]


def test_concurrent_adds_and_reads() -> None:
    estimator = OnlineEstimator(min_positions=200, refit_every=200)
    versions: list[int] = []

    def reader() -> None:
        for _ in range(200):
            versions.append(estimator.current_policy().version)
            estimator.status()

    def writer(first_request: int) -> None:
        for request in range(first_request, first_request + 5):
            estimator.add(_request(request))

    threads = [threading.Thread(target=reader)] + [
        threading.Thread(target=writer, args=(10 * k,)) for k in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert estimator.status()["positions_seen"] == 600
    assert versions == sorted(versions)
    assert estimator.current_policy().version >= 1


def test_a_served_bias_and_its_temperature_are_kept() -> None:
    profile = sample_profile(Rule.CALIBRATED)
    bias = sample_bias(profile, "ab" * 32, 200, temperature=1.1)
    served = profile.model_copy(update={"bias": bias})
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(served, settings=settings, min_positions=400, refit_every=400)
    assert estimator.current_policy() == served.to_policy()
    assert not estimator.reads_kl_curves
    for request in range(10):
        estimator.add(_request(request))
    policy = estimator.current_policy()
    assert (policy.version, policy.rule, policy.bias) == (1, Rule.FIXED, bias.sha256)
    assert policy.fixed_temperature == 1.1  # fitted with the bias: no T-only refit
    assert policy.alpha_by_step != profile.parameters.alpha_by_step


def test_without_an_online_bias_the_served_bias_is_kept_by_every_version() -> None:
    profile = sample_profile(Rule.CALIBRATED)
    bias = sample_bias(profile, "ab" * 32, 200)
    served = profile.model_copy(update={"bias": bias})
    settings = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(served, settings=settings, min_positions=400, refit_every=400)
    assert estimator.current_policy().bias == bias.sha256
    for request in range(20):
        estimator.add(_request(request))
    policy = estimator.current_policy()
    assert policy.version == 2
    assert policy.bias == bias.sha256


def _without_curves(records: PositionRecords) -> PositionRecords:
    """`records` as the live scorer makes them when no refitted rule reads KL curves."""
    grid = records.curve_temperatures[:0]
    return dataclasses.replace(records, kl_curve=records.kl_curve[:, :0], curve_temperatures=grid)


def test_a_banded_calibrated_table_is_kept_and_the_noise_refitted() -> None:
    profile = sample_profile(Rule.CALIBRATED)  # two request-temperature bands
    settings = CalibrationSettings(step_edges=(0, 4), entropy_buckets=1, min_cell_positions=40)
    estimator = OnlineEstimator(profile, settings=settings, min_positions=400, refit_every=400)
    assert not estimator.reads_kl_curves  # the table is kept: only alpha / sigma2 are refitted
    for request in range(10):
        estimator.add(_without_curves(_request(request)))
    policy = estimator.current_policy()
    assert policy.version == 1
    assert policy.calibrated == profile.to_policy().calibrated
    assert policy.alpha_by_step != profile.parameters.alpha_by_step
