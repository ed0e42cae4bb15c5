"""Parsing and resolution of the flat ``nts_*`` request keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from noisy_temp_server.engine_contract.keys import POLICY_FILE_ENV
from noisy_temp_server.engine_contract.request_args import (
    LogitCorrection,
    TuningKeys,
    default_policy_json,
    issue_extra_args,
    parse_policy_json,
    parse_request_args,
    resolve_correction,
    resolve_request,
)
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

SQRT = TemperaturePolicy(version=3, rule=Rule.SQRT, alpha_by_step=(0.44,))


@pytest.fixture(autouse=True)
def _no_policy_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)


def test_defaults() -> None:
    assert parse_request_args(None) == TuningKeys()
    assert parse_request_args({"other_plugin_key": 1}) == TuningKeys()


def test_round_trip_through_extra_args() -> None:
    args = TuningKeys(
        tune=False,
        rule=Rule.FIXED,
        fixed_t=1.5,
        t_min=0.5,
        t_max=2.0,
        trace=True,
        policy_json=SQRT.to_json(),
        trace_id="abc",
    )
    assert parse_request_args(args.to_extra_args()) == args
    assert TuningKeys().to_extra_args() == {}


def test_keys_this_process_issued_come_back_once_without_a_parse() -> None:
    issued = TuningKeys(rule=Rule.FIXED, fixed_t=1.5, policy_json=SQRT.to_json(), trace_id="x1")
    extra_args = {"seed_of_another": 3, **issue_extra_args(issued)}
    assert extra_args == {"seed_of_another": 3, **issued.to_extra_args()}
    assert parse_request_args(extra_args) is issued  # vLLM's validate_params in the API process
    again = parse_request_args(extra_args)  # parsed, as the engine process does
    assert again == issued
    assert again is not issued
    alike = {**issued.to_extra_args(), "nts_t": "1.5"}  # the same key, another value type
    issue_extra_args(issued)
    assert parse_request_args(alike) is not issued
    with pytest.raises(ValueError, match="nts_t"):
        parse_request_args({**issued.to_extra_args(), "nts_t": [1.5]})  # unhashable: parsed


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"nts_tune": "false", "nts_trace": "1"}, TuningKeys(tune=False, trace=True)),
        ({"nts_tune": 0}, TuningKeys(tune=False)),
        ({"nts_rule": " Linear "}, TuningKeys(rule=Rule.LINEAR)),
        ({"nts_t": "2.5", "nts_t_max": 3}, TuningKeys(fixed_t=2.5, t_max=3.0)),
    ],
)
def test_accepts_strings_and_numbers(keys: dict[str, Any], expected: TuningKeys) -> None:
    assert parse_request_args(keys) == expected


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"nts_rule": "hot"}, "nts_rule='hot' is not a rule; use one of: off fixed"),
        ({"nts_t": 0.0}, "nts_t must be > 0"),
        ({"nts_t": -1}, "nts_t must be > 0"),
        ({"nts_t": float("nan")}, "nts_t must be finite"),
        ({"nts_t": "warm"}, "nts_t must be a number"),
        ({"nts_t": True}, "nts_t must be a number"),
        ({"nts_t_min": 0.9, "nts_t_max": 0.8}, "nts_t_min=0.9 is greater than nts_t_max=0.8"),
        ({"nts_t_min": 1.5}, "t_min must satisfy"),
        ({"nts_t_max": 0.5}, "t_max must satisfy"),
        ({"nts_tune": "maybe"}, "nts_tune must be a boolean"),
        ({"nts_policy": "{"}, "nts_policy is not a valid temperature policy JSON"),
        ({"nts_policy": '{"rule": "hot"}'}, "nts_policy is not a valid temperature policy JSON"),
        ({"nts_trace_id": ""}, "nts_trace_id must be a non-empty string"),
        ({"nts_temperature": 2}, "Unknown noisy-temp-server request key"),
        ({"nts_runtime_noise_sigma": -1}, "nts_runtime_noise_sigma must be >= 0"),
        (
            {"nts_rule": "linear", "nts_t": 1.5},
            "nts_t only applies to nts_rule=fixed, got nts_rule='linear'",
        ),
    ],
)
def test_rejects_bad_values_with_a_clear_message(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_request_args(keys)


def test_resolve_applies_overrides_on_the_policy() -> None:
    args = parse_request_args({"nts_policy": SQRT.to_json(), "nts_t_max": 1.1, "nts_trace_id": "t"})
    resolved = resolve_request(args, 0.7)
    assert resolved is not None
    assert resolved.policy == SQRT
    assert (resolved.t_min, resolved.t_max, resolved.trace_id) == (SQRT.bounds.t_min, 1.1, "t")
    fixed = resolve_request(
        parse_request_args({"nts_policy": SQRT.to_json(), "nts_rule": "fixed", "nts_t": 2}), 1.0
    )
    assert fixed is not None
    assert (fixed.rule, fixed.fixed_t, fixed.policy.version) == (Rule.FIXED, 2.0, 3)


def test_resolved_tuning_carries_the_trace_request() -> None:
    asked = resolve_request(parse_request_args({"nts_policy": SQRT.to_json(), "nts_trace": 1}), 1.0)
    unasked = resolve_request(parse_request_args({"nts_policy": SQRT.to_json()}), 1.0)
    assert asked is not None
    assert unasked is not None
    assert (asked.trace, unasked.trace) == (True, False)


def test_fixed_without_nts_t_uses_the_policy_fixed_temperature() -> None:
    fitted = TemperaturePolicy(version=2, rule=Rule.SQRT, fixed_temperature=1.7)
    args = parse_request_args({"nts_policy": fitted.to_json(), "nts_rule": "fixed"})
    resolved = resolve_request(args, 1.0)
    assert resolved is not None
    assert (resolved.rule, resolved.fixed_t) == (Rule.FIXED, 1.7)


def test_nts_t_without_a_rule_applies_to_a_fixed_policy_and_is_refused_otherwise() -> None:
    fixed = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.7)
    resolved = resolve_request(
        parse_request_args({"nts_policy": fixed.to_json(), "nts_t": 1.2}), 1.0
    )
    assert resolved is not None
    assert (resolved.rule, resolved.fixed_t) == (Rule.FIXED, 1.2)
    keys = parse_request_args({"nts_policy": SQRT.to_json(), "nts_t": 1.2})
    for request_temperature in (1.0, 0.0):  # a greedy request's keys are checked too
        with pytest.raises(ValueError, match=r"nts_t only applies to the fixed rule.*'sqrt'"):
            resolve_request(keys, request_temperature)


@pytest.mark.parametrize(
    ("keys", "temperature"),
    [
        ({}, 1.0),  # identity default policy
        ({"nts_policy": SQRT.to_json(), "nts_tune": False}, 1.0),
        ({"nts_policy": SQRT.to_json()}, 0.0),  # greedy
        ({"nts_policy": SQRT.to_json(), "nts_rule": "off"}, 1.0),
    ],
)
def test_untuned_requests_resolve_to_none(keys: dict[str, Any], temperature: float) -> None:
    assert resolve_request(parse_request_args(keys), temperature) is None


def test_policy_file_is_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(SQRT.to_json())
    monkeypatch.setenv(POLICY_FILE_ENV, str(path))
    assert TemperaturePolicy.from_json(default_policy_json()) == SQRT
    resolved = resolve_request(parse_request_args(None), 1.0)
    assert resolved is not None
    assert resolved.policy == SQRT


def test_bad_policy_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(POLICY_FILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        default_policy_json()


def test_policy_is_parsed_once_per_text() -> None:
    text = SQRT.to_json()
    assert parse_policy_json(text) is parse_policy_json(text)


def test_the_bias_comes_from_the_policy_unless_the_request_turns_it_off() -> None:
    sha = "ab" * 32
    policy = TemperaturePolicy(rule=Rule.OFF, bias=sha).to_json()
    resolved = resolve_correction(parse_request_args({"nts_policy": policy}))
    assert resolved == LogitCorrection(sha)  # rule off, still on
    for off in ({"nts_bias": "no"}, {"nts_tune": False}):
        assert resolve_correction(parse_request_args({"nts_policy": policy, **off})) is None
    assert resolve_correction(parse_request_args({"nts_policy": SQRT.to_json()})) is None
    keys = parse_request_args({"nts_bias": False})
    assert keys.bias is False
    assert parse_request_args(keys.to_extra_args()) == keys
    with pytest.raises(ValueError, match="nts_bias must be a boolean"):
        parse_request_args({"nts_bias": 2})
