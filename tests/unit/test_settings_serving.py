"""The serving fields of Settings: environment, CLI flags, validation."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

import noisy_temp_server
from noisy_temp_server.settings import (
    DEFAULT_PERTURBATION,
    Settings,
    add_settings_arguments,
    settings_as_json,
    settings_from_args,
)


def _parse(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_from_args(parser.parse_args(argv))


def test_defaults_serve_on_loopback_port_8000() -> None:
    settings = Settings()
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.api_key is None
    assert settings.served_model is None
    assert settings.perturbation == DEFAULT_PERTURBATION


def test_every_command_prints_its_help() -> None:
    """A description with a % once made `serve --help` crash (argparse formats help with %)."""
    from noisy_temp_server.cli import build_parser  # noqa: PLC0415

    parser = build_parser()
    commands = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    for name, command in commands.choices.items():
        assert "--" in command.format_help(), name
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    assert "within 1 % of float32" in " ".join(parser.format_help().split())


def test_environment_then_flags_take_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NTS_PORT", "9001")
    monkeypatch.setenv("NTS_SHADOW_FRACTION", "0.5")
    settings = _parse(["--shadow-fraction", "0.25", "--enforce-eager", "false"])
    assert settings.port == 9001
    assert settings.shadow_fraction == 0.25
    assert settings.enforce_eager is False


def test_tensor_parallel_size_defaults_to_one_gpu_and_is_read_from_env_and_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().tensor_parallel_size == 1
    monkeypatch.setenv("NTS_TENSOR_PARALLEL_SIZE", "4")
    assert _parse([]).tensor_parallel_size == 4
    assert _parse(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_flags_not_given_leave_defaults() -> None:
    assert _parse([]) == Settings()


def test_api_key_is_masked_in_the_startup_dump() -> None:
    settings = _parse(["--api-key", "sekrit"])
    assert settings.api_key is not None
    assert settings.api_key.get_secret_value() == "sekrit"
    assert "sekrit" not in settings_as_json(settings)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"shadow_fraction": 1.5}, "less than or equal"),
        ({"default_t_min": 2.0, "default_t_max": 1.5}, "must not exceed"),
        ({"default_t_min": 1.5}, "t_min"),
        ({"default_rule": "hot"}, "Input should be"),
        ({"perturbation": '{"kind": "magic"}'}, "perturbation spec"),
        ({"kv_cache_gib": 0}, "greater than or equal"),
        ({"tensor_parallel_size": 0}, "greater than or equal"),
        ({"default_rule": "linear", "default_t": 1.2}, "applies to the `fixed` rule only"),
        ({"shadow_min_positions": 4096, "shadow_window_positions": 1024}, "at least"),
    ],
)
def test_bad_values_fail_at_startup(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**fields)  # type: ignore[arg-type]


def test_bad_flag_value_names_the_field() -> None:
    with pytest.raises(ValidationError, match="port"):
        _parse(["--port", "eighty"])


def test_every_field_is_read_by_the_package() -> None:
    """A setting nobody reads would take an operator's value and do nothing with it: each
    field is read as `settings.<field>` (the object's name wherever it is passed) somewhere in
    the package, the settings module's own derivations (`engine_settings`) included."""
    package = Path(noisy_temp_server.__file__).parent
    sources = "\n".join(path.read_text(encoding="utf-8") for path in package.rglob("*.py"))
    unread = [
        name for name in Settings.model_fields if not re.search(rf"settings\.{name}\b", sources)
    ]
    assert unread == []
