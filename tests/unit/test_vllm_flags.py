"""vLLM's own flags on `serve` (`server.vllm_flags`): read by `vllm serve`'s parser, the engine's
applied over the engine arguments `serve` builds, refused in one line where they cannot mean the
same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from noisy_temp_server import cli
from noisy_temp_server.server import engine
from noisy_temp_server.server.vllm_flags import engine_flag_overrides
from noisy_temp_server.settings import Settings


def test_the_flags_given_are_read_by_vllms_parser() -> None:
    overrides = engine_flag_overrides("--enable-prefix-caching --kv-cache-dtype fp8 --seed 3")
    assert overrides == {"enable_prefix_caching": True, "kv_cache_dtype": "fp8", "seed": 3}
    assert engine_flag_overrides("") == {}
    logs = engine_flag_overrides("--disable-log-stats --enable-log-requests")
    assert logs == {"disable_log_stats": True, "enable_log_requests": True}  # the user's logs


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ("--no-such-flag", "not a flag of vllm serve nor of serve: --no-such-flag"),
        ("--host 0.0.0.0", "--host is a setting of serve"),
        ("--kv-cache-dtype bogus", "invalid choice: 'bogus'"),
        ("--max-model-len 512", "--max-model-len is a setting of serve"),
        ("--served-model-name x", "--served-model-name is a setting of serve"),
        ("--logits-processors a.B", "--logits-processors is set by serve itself"),
        ("--seed 'unclosed", "vLLM flags: No closing quotation"),
    ],
)
def test_flags_that_cannot_mean_the_same_are_refused_in_one_line(flags: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        engine_flag_overrides(flags)
    assert "\n" not in str(refused.value)


def test_the_engine_gets_them_over_what_serve_builds(tiny_model_dir: Path) -> None:
    settings = Settings(vllm_args="--enable-prefix-caching --seed 7", max_model_len=512)
    args = engine.build_engine_args(settings, tiny_model_dir, "m")
    assert args.enable_prefix_caching is True
    assert args.seed == 7
    assert args.max_model_len == 512  # serve's own settings are untouched
    assert args.model == str(tiny_model_dir)  # and so is what serve sets itself


def _settings_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    seen: list[Settings] = []

    def fake_serve(settings: Settings, log_level: str) -> int:
        seen.append(settings)
        return 0

    monkeypatch.setattr("noisy_temp_server.server.launch.serve", fake_serve)
    assert cli.main(["serve", *argv]) == 0
    (settings,) = seen
    return settings


def test_serve_takes_the_flags_it_does_not_have_as_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings_of(
        ["--max-model-len", "512", "--enable-chunked-prefill", "--kv-cache-dtype", "fp8"],
        monkeypatch,
    )
    assert settings.max_model_len == 512
    assert settings.vllm_args == "--enable-chunked-prefill --kv-cache-dtype fp8"


def test_given_vllm_args_and_unknown_flags_are_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings_of(["--vllm-args", "--seed 1", "--enable-prefix-caching"], monkeypatch)
    assert settings.vllm_args == "--seed 1 --enable-prefix-caching"


def test_other_commands_refuse_unknown_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["kld", "--enable-prefix-caching"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --enable-prefix-caching" in capsys.readouterr().err


def test_no_flag_is_taken_as_an_abbreviation_of_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings_of(["--max-num", "4"], monkeypatch)  # not --max-num-seqs
    assert settings.max_num_seqs is None
    assert settings.vllm_args == "--max-num 4"
