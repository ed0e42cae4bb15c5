"""`perturb` and `calibrate` commands end to end on the tiny model (fast settings)."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import pytest

from noisy_temp_server.adapter.lora import adapter_folder_name, find_adapter
from noisy_temp_server.calibration import pipeline
from noisy_temp_server.calibration.profile import ModelIdentity, Profile, ProfileError
from noisy_temp_server.calibration.settings import calibration_settings_from_args
from noisy_temp_server.commands import calibrate as calibrate_command
from noisy_temp_server.commands import perturb as perturb_command
from noisy_temp_server.correction.files import bias_file_name
from noisy_temp_server.temperature.policy import TemperaturePolicy


def _run(module: object, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return int(module.run(parser.parse_args(argv)))  # type: ignore[attr-defined]


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_perturb_then_calibrate(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = '{"kind": "quantization", "format": "int4", "group_size": 16}'
    for name in ("a", "b"):
        argv = ["--spec", spec, "--out", str(tmp_path / name), "--clean", str(tiny_model_dir)]
        assert _run(perturb_command, argv) == 0
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b") != _sha(tiny_model_dir)

    profile_path = tmp_path / "profile.json"
    argv = [
        "--clean",
        str(tiny_model_dir),
        "--served",
        str(tmp_path / "a"),
        "--out",
        str(profile_path),
        "--num-prompts",
        "24",
        "--max-new-tokens",
        "20",
        "--validation-fraction",  # halved into selection and gate: 6 gate prompts, 120 rows
        "0.5",
        "--bias-rows",
        "1000",
        "--records",
        str(tmp_path / "records.safetensors"),
        "--report",
        str(tmp_path / "report"),
    ]
    assert _run(calibrate_command, argv) == 0
    printed = capsys.readouterr().out
    assert printed.index("Validation split at") < printed.index("Test split at")
    assert "Test split at request temperature 0.5: " in printed
    assert "its test row is the figure to quote" in printed or "recommended rule: off" in printed
    clean, served = (ModelIdentity.of_checkpoint(p) for p in (tiny_model_dir, tmp_path / "a"))
    profile = Profile.load_for_pair(profile_path, clean, served)
    assert profile.perturbation is not None
    assert profile.perturbation.kind == "quantization"
    written = TemperaturePolicy.from_json((tmp_path / "profile.policy.json").read_text())
    assert written == profile.to_policy()
    assert profile.bias is not None
    assert profile.settings.bias_rows == 1000
    assert (tmp_path / bias_file_name(profile.bias.sha256)).is_file()
    assert f"recommended policy (NTS_POLICY_FILE): {tmp_path / 'profile.policy.json'}" in printed
    assert (tmp_path / "report" / "report.md").is_file()
    assert len(list((tmp_path / "report").glob("*.png"))) == 4
    with pytest.raises(ProfileError, match="served model"):
        Profile.load_for_pair(profile_path, clean, clean)
    # the same spec applied in memory is the same served model
    assert profile.perturbation is not None
    in_memory = ModelIdentity.perturbed(clean, profile.perturbation)
    assert Profile.load_for_pair(profile_path, clean, in_memory) == profile


def test_profile_calibrated_in_memory_serves_the_perturbed_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = '{"kind": "weight_noise", "scale": 0.1, "seed": 3}'
    profile_path = tmp_path / "profile.json"
    argv = ["--clean", str(tiny_model_dir), "--spec", spec, "--out", str(profile_path)]
    sizes = ["--num-prompts", "24", "--max-new-tokens", "20", "--validation-fraction", "0.5"]
    assert _run(calibrate_command, [*argv, *sizes]) == 0
    for name, written_spec in (("same", spec), ("other", spec.replace('"seed": 3', '"seed": 4'))):
        argv = [
            "--spec",
            written_spec,
            "--out",
            str(tmp_path / name),
            "--clean",
            str(tiny_model_dir),
        ]
        assert _run(perturb_command, argv) == 0
    clean, same, other = (
        ModelIdentity.of_checkpoint(p)
        for p in (tiny_model_dir, tmp_path / "same", tmp_path / "other")
    )
    assert Profile.load_for_pair(profile_path, clean, same).served.weights_sha256 is None
    with pytest.raises(ProfileError, match=r"weights only in memory.*the served model is other"):
        Profile.load_for_pair(profile_path, clean, other)


def test_calibrate_refuses_too_few_positions(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _noisy_pair(tiny_model_dir, tmp_path / "p.json", prompts=8, tokens=4)
    assert _run(calibrate_command, argv) == 1
    assert "at least 100" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_calibrate_measures_the_request_temperatures_it_is_given(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _small_calibration(tiny_model_dir, tmp_path / "p.json", "--bias-rows", "1000")
    assert _run(calibrate_command, [*base, "--request-temperatures", "0.5,0.8"]) == 1
    assert "include 1.0" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
    assert _run(calibrate_command, [*base, "--request-temperatures", "0.8,1.0"]) == 0
    printed = capsys.readouterr().out
    assert "Test split at request temperature 0.8: " in printed
    assert "Test split at request temperature 0.5: " not in printed
    profile = Profile.model_validate_json((tmp_path / "p.json").read_text())
    assert profile.settings.request_temperatures == (0.8, 1.0)


def _noisy_pair(clean: Path, out: Path, *, prompts: int, tokens: int) -> list[str]:
    """`calibrate` arguments for the tiny model under weight noise, written to `out`."""
    spec = '{"kind": "weight_noise", "scale": 0.1}'
    pair = ["--clean", str(clean), "--spec", spec, "--out", str(out)]
    return [*pair, "--num-prompts", str(prompts), "--max-new-tokens", str(tokens)]


def _small_calibration(clean: Path, out: Path, *flags: str) -> list[str]:
    """`_noisy_pair` at 24 prompts of 20 tokens, half of them for validation, then `flags`."""
    pair = _noisy_pair(clean, out, prompts=24, tokens=20)
    return [*pair, "--validation-fraction", "0.5", *flags]


def test_calibrate_fits_an_adapter_first_and_saves_it_beside_the_profile(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _small_calibration(
        tiny_model_dir, tmp_path / "p.json", "--bias-rows", "500", "--adapter-rank", "8"
    )
    assert _run(calibrate_command, argv) == 0
    out = capsys.readouterr().out
    assert "Adapter: rank 8 propagated, 14 layers" in out
    profile = Profile.model_validate_json((tmp_path / "p.json").read_text())
    adapter = profile.adapter
    assert adapter is not None
    assert profile.settings.adapter_rank == 8
    assert adapter.ridge is not None
    assert adapter.ridge > 0
    assert adapter.test.gain > 0
    folder, loaded = find_adapter([tmp_path], adapter.sha256)
    assert folder.name == adapter_folder_name(adapter.sha256)
    assert loaded.rank == 8
    assert len(loaded.layers) == adapter.layers == 14


def test_calibrate_refuses_an_adapter_where_the_served_weights_are_the_clean_ones(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = '{"kind": "runtime_logit_noise", "sigma": 0.5}'
    argv = ["--clean", str(tiny_model_dir), "--spec", spec, "--out", str(tmp_path / "p.json")]
    parser = argparse.ArgumentParser()
    calibrate_command.add_arguments(parser)
    flag_alone = parser.parse_args([*argv, "--adapter-rank"])
    assert calibration_settings_from_args(flag_alone, prompts=24).adapter_rank == 64
    assert _run(calibrate_command, [*argv, "--num-prompts", "24", "--adapter-rank"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --adapter-rank needs a pair whose served weights differ")
    assert not (tmp_path / "p.json").exists()


def test_calibrate_refuses_a_rank_above_a_layers_side_before_sampling(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_sampling(*_: object, **__: object) -> None:
        raise AssertionError("sampled before the rank was checked")

    monkeypatch.setattr(pipeline, "sample_completions", no_sampling)
    argv = _small_calibration(tiny_model_dir, tmp_path / "p.json", "--adapter-rank", "33")
    assert _run(calibrate_command, argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: adapter rank 33 must be between 1 and 32, the smallest ")
    assert "perturbed layer model.layers.0." in err[-1]
    assert not (tmp_path / "p.json").exists()


def test_calibrate_distils_the_adapter_when_asked_and_records_it(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _small_calibration(
        tiny_model_dir,
        tmp_path / "p.json",
        *("--adapter-rank", "8", "--adapter-distil-epochs", "2"),
        *("--adapter-distil-completions", "2", "--adapter-fit-completions", "2"),
    )
    assert _run(calibrate_command, argv) == 0
    assert "distilled 2 epochs, epoch " in capsys.readouterr().out
    profile = Profile.model_validate_json((tmp_path / "p.json").read_text())
    assert profile.adapter is not None
    distillation = profile.adapter.distillation
    assert distillation is not None
    assert (distillation.epochs, len(distillation.selection_kl)) == (2, 3)
    settings = profile.settings
    assert (
        settings.adapter_distil_epochs,
        settings.adapter_distil_completions,
        settings.adapter_fit_completions,
    ) == (2, 2, 2)
    find_adapter([tmp_path], profile.adapter.sha256)  # the distilled adapter is the one saved


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--adapter-distil-epochs", "2"], "adapter distillation needs an adapter"),
        (["--adapter-rank", "8", "--adapter-distil-epochs", "-1"], "adapter_distil_epochs"),
        (["--adapter-fit-completions", "2"], "adapter_fit_completions > 1 needs an adapter"),
        (
            ["--adapter-rank", "8", "--adapter-method", "svd", "--adapter-fit-completions", "2"],
            "adapter_fit_completions > 1 needs an adapter fitted on its inputs",
        ),
        (["--adapter-rank", "8", "--adapter-fit-completions", "0"], "adapter_fit_completions"),
    ],
)
def test_calibrate_refuses_bad_adapter_settings_in_one_line(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    says: str,
) -> None:
    argv = [*_noisy_pair(tiny_model_dir, tmp_path / "p.json", prompts=24, tokens=20), *flags]
    assert _run(calibrate_command, argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: invalid calibration settings: ")
    assert says in err[0]
    assert not (tmp_path / "p.json").exists()
