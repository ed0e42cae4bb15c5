"""`noisy-temp-server policy`: a profile's policy as the JSON the processor reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from profile_helpers import sample_profile

from noisy_temp_server.calibration import profile as profile_module
from noisy_temp_server.cli import main
from noisy_temp_server.temperature.policy import TemperaturePolicy


def test_bad_profile_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text("{not json", encoding="utf-8")
    assert main(["policy", str(profile)]) == 1
    assert str(profile) in capsys.readouterr().err


def test_profile_with_invalid_parameters_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    document = json.loads(sample_profile().model_dump_json())
    document["parameters"]["fixed_temperature"] = -1.0
    profile.write_text(json.dumps(document), encoding="utf-8")
    assert main(["policy", str(profile)]) == 1
    err = capsys.readouterr().err
    assert str(profile) in err
    assert "fixed_temperature" in err
    assert "Traceback" not in err


def test_unknown_rule_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["policy", str(tmp_path / "profile.json"), "--rule", "cubic"])


def test_prints_the_policy_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = TemperaturePolicy.identity().with_overrides(rule="fixed", fixed_temperature=1.25)

    class _Profile:
        @staticmethod
        def load(path: Path) -> _Profile:
            assert path == tmp_path / "profile.json"
            return _Profile()

        def to_policy(self, rule: str | None) -> TemperaturePolicy:
            assert rule == "fixed"
            return policy

    monkeypatch.setattr(profile_module, "Profile", _Profile)
    assert main(["policy", str(tmp_path / "profile.json"), "--rule", "fixed"]) == 0
    assert TemperaturePolicy.from_json(capsys.readouterr().out.strip()) == policy
