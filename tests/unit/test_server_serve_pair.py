"""`serve`'s pair resolution: which folder is served, what it is scored against, which runtime
noise the engine and the shadow scorer add (tiny model; no engine is started)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from profile_helpers import CLEAN, SERVED, sample_profile
from transformers import AutoConfig

from noisy_temp_server.calibration.profile import ModelIdentity, Profile, ProfileError
from noisy_temp_server.checkpoints.checkpoint import MANIFEST_FILENAME
from noisy_temp_server.checkpoints.perturbation import (
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
    parse_spec,
)
from noisy_temp_server.checkpoints.perturbed_checkpoint import (
    ensure_perturbed_checkpoint,
    write_perturbed_checkpoint,
)
from noisy_temp_server.commands import serve
from noisy_temp_server.correction.files import bias_sha256, load_bias_file, save_bias_file
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, RUNTIME_NOISE_SEED_ENV
from noisy_temp_server.online import startup
from noisy_temp_server.online.startup import (
    DEFAULT_PAIR_PROFILE,
    check_served_bias,
    load_profile_for_pair,
    pair_scorer,
    serves_default_pair,
    startup_profile,
)
from noisy_temp_server.scoring.clean_backend import InProcessModel
from noisy_temp_server.scoring.served_pair import ServedPair
from noisy_temp_server.server import engine as engine_module
from noisy_temp_server.server.launch import resolve_pair
from noisy_temp_server.settings import DEFAULT_PERTURBATION, Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

NOISE = RuntimeLogitNoiseSpec(sigma=1.0, seed=3)


@pytest.fixture(scope="module")
def runtime_noise_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `noisy-temp-server perturb` writes for runtime noise: clean weights + the spec."""
    dest = tmp_path_factory.mktemp("perturbed") / "tiny-runtime-noise"
    write_perturbed_checkpoint(tiny_model_dir, NOISE, dest, source="test")
    return dest


def test_runtime_noise_perturbation_serves_the_clean_weights_without_a_copy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = Settings(
        perturbation=NOISE.model_dump_json(), clean_model=tiny_model_dir, cache_dir=tmp_path
    )
    pair = resolve_pair(settings)
    assert pair == ServedPair(tiny_model_dir, tiny_model_dir, NOISE)
    assert pair.runtime_noise == NOISE
    assert list(tmp_path.iterdir()) == []


def test_served_model_recording_runtime_noise_is_served_with_it_and_scores_against_itself(
    runtime_noise_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="noisy_temp_server.scoring.served_pair"):
        pair = resolve_pair(Settings(served_model=runtime_noise_dir))
    assert pair == ServedPair(runtime_noise_dir, runtime_noise_dir, NOISE)
    assert pair.runtime_noise == NOISE
    assert "runtime logit noise sigma=1" in caplog.text


def test_an_explicit_clean_model_is_kept_for_a_runtime_noise_checkpoint(
    runtime_noise_dir: Path, tiny_model_dir: Path
) -> None:
    pair = resolve_pair(Settings(served_model=runtime_noise_dir, clean_model=tiny_model_dir))
    assert (pair.clean, pair.runtime_noise) == (tiny_model_dir, NOISE)


def test_served_weight_perturbation_adds_no_runtime_noise(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = WeightNoiseSpec(scale=0.1)
    served = ensure_perturbed_checkpoint(tiny_model_dir, spec, tmp_path)
    pair = resolve_pair(Settings(served_model=served))
    assert pair == ServedPair(served, None, spec)
    assert pair.runtime_noise is None


def test_served_folder_without_manifest_has_no_spec(tiny_model_dir: Path, tmp_path: Path) -> None:
    plain = shutil.copytree(tiny_model_dir, tmp_path / "plain")
    (plain / MANIFEST_FILENAME).unlink()
    assert resolve_pair(Settings(served_model=plain)) == ServedPair(plain, None, None)


def test_the_shadow_scorer_holds_the_clean_model_only(
    tiny_model_dir: Path, runtime_noise_dir: Path, tmp_path: Path
) -> None:
    """The served side comes from the engine's captured rows (noise included): no served model
    and no noise of its own in the API process, for either kind of pair."""
    served = ensure_perturbed_checkpoint(tiny_model_dir, WeightNoiseSpec(scale=0.1), tmp_path)
    for pair in (
        ServedPair(served, tiny_model_dir, WeightNoiseSpec(scale=0.1)),
        ServedPair(runtime_noise_dir, runtime_noise_dir, NOISE),
    ):
        scorer = pair_scorer(Settings(clean_dtype="float32"), pair)
        assert scorer.served is None
        assert scorer.runtime_noise is None
        assert isinstance(scorer.clean, InProcessModel)
        assert scorer.clean.model.dtype == torch.float32
        assert scorer.clean_status() == {"kind": "in_process", "device": "cpu", "dtype": "float32"}


def _profile_for(clean: ModelIdentity, served: ModelIdentity, path: Path) -> Path:
    sample_profile().model_copy(update={"clean": clean, "served": served}).save(path)
    return path


def test_a_profile_of_the_served_pair_is_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = WeightNoiseSpec(scale=0.1)
    served = ensure_perturbed_checkpoint(tiny_model_dir, spec, tmp_path)
    clean_identity = ModelIdentity.of_checkpoint(tiny_model_dir)
    path = _profile_for(
        clean_identity, ModelIdentity.perturbed(clean_identity, spec), tmp_path / "p.json"
    )
    pair = ServedPair(served, tiny_model_dir, spec)
    assert load_profile_for_pair(path, pair).served.perturbation == spec


def test_a_profile_of_another_perturbation_is_refused_naming_the_mismatch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    clean_identity = ModelIdentity.of_checkpoint(tiny_model_dir)
    int4 = QuantizationSpec(format="int4", group_size=64)
    path = _profile_for(
        clean_identity, ModelIdentity.perturbed(clean_identity, int4), tmp_path / "int4.json"
    )
    spec = WeightNoiseSpec(scale=0.1)
    served = ensure_perturbed_checkpoint(tiny_model_dir, spec, tmp_path)
    for pair in (ServedPair(served, tiny_model_dir, spec), ServedPair(served, None, spec)):
        with pytest.raises(ProfileError, match=r"int4\.json.*served model.*int4.*weight noise"):
            load_profile_for_pair(path, pair)


def test_runtime_noise_on_clean_weights_matches_its_calibration(
    tiny_model_dir: Path, runtime_noise_dir: Path, tmp_path: Path
) -> None:
    clean_identity = ModelIdentity.of_checkpoint(tiny_model_dir)
    path = _profile_for(
        clean_identity, ModelIdentity.perturbed(clean_identity, NOISE), tmp_path / "p.json"
    )
    for pair in (
        ServedPair(tiny_model_dir, tiny_model_dir, NOISE),
        ServedPair(runtime_noise_dir, runtime_noise_dir, NOISE),
        ServedPair(runtime_noise_dir, tiny_model_dir, NOISE),
    ):
        assert load_profile_for_pair(path, pair).served.perturbation == NOISE
    with pytest.raises(ProfileError, match="served model"):
        load_profile_for_pair(path, ServedPair(tiny_model_dir, tiny_model_dir, None))


def test_a_profile_is_checked_against_a_plain_folder_by_its_content_hash(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = shutil.copytree(tiny_model_dir, tmp_path / "plain")
    (plain / MANIFEST_FILENAME).unlink()
    cache = tmp_path / "cache"
    mismatched = _profile_for(CLEAN, SERVED, tmp_path / "p.json")
    with pytest.raises(ProfileError, match=r"but the served model is plain \(weights sha256"):
        load_profile_for_pair(mismatched, ServedPair(plain, None, None), cache)
    identity = ModelIdentity.of_checkpoint(plain, cache)
    assert identity.weights_sha256 == ModelIdentity.of_checkpoint(tiny_model_dir).weights_sha256
    matching = _profile_for(CLEAN, identity, tmp_path / "q.json")
    assert load_profile_for_pair(matching, ServedPair(plain, None, None), cache).served == identity


def test_serve_refuses_a_mismatched_profile_with_an_error_line_and_exit_status_1(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clean_identity = ModelIdentity.of_checkpoint(tiny_model_dir)
    int4 = QuantizationSpec(format="int4", group_size=64)
    profile = _profile_for(
        clean_identity, ModelIdentity.perturbed(clean_identity, int4), tmp_path / "int4.json"
    )
    served = ensure_perturbed_checkpoint(tiny_model_dir, WeightNoiseSpec(scale=0.1), tmp_path)
    cleaned: list[bool] = []

    class Environment:
        trace_endpoint = "ipc://unused"

        def cleanup(self) -> None:
            cleaned.append(True)

    monkeypatch.setattr(engine_module, "prepare_environment", lambda settings: Environment())
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        [
            "--served-model",
            str(served),
            "--clean-model",
            str(tiny_model_dir),
            "--profile",
            str(profile),
        ]
    )
    with caplog.at_level(logging.ERROR, logger="noisy_temp_server.serve"):
        assert serve.run(args) == 1
    assert "Refusing to serve: profile" in caplog.text
    assert "int4" in caplog.text
    assert cleaned == [True]


DEFAULT_NOISE = RuntimeLogitNoiseSpec(sigma=1.0)


def test_the_default_pair_is_runtime_logit_noise_spelled_any_way() -> None:
    assert parse_spec(Settings().perturbation) == DEFAULT_NOISE
    assert serves_default_pair(Settings())
    assert serves_default_pair(
        Settings(perturbation='{"sigma": 1.0, "kind": "runtime_logit_noise"}')
    )
    assert not serves_default_pair(
        Settings(perturbation=WeightNoiseSpec(scale=0.02).model_dump_json())
    )
    assert not serves_default_pair(Settings(served_model=Path("/x")))
    assert not serves_default_pair(Settings(clean_model=Path("/x")))


def test_the_default_pair_starts_from_the_shipped_profile_if_it_fits(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clean_identity = ModelIdentity.of_checkpoint(tiny_model_dir)
    fitting = _profile_for(
        clean_identity, ModelIdentity.perturbed(clean_identity, DEFAULT_NOISE), tmp_path / "d.json"
    )
    pair = ServedPair(tiny_model_dir, tiny_model_dir, DEFAULT_NOISE)
    monkeypatch.setattr(startup, "DEFAULT_PAIR_PROFILE", fitting)
    profile, path, source = startup_profile(Settings(), pair)
    assert profile is not None
    assert path == fitting  # its folder holds its bias file (not that of `--profile`: none)
    assert source == "the shipped profile of the default pair"
    # another pair: no shipped profile; an explicit one is loaded (or refused) as before
    int4 = QuantizationSpec(format="int4", group_size=64)
    assert startup_profile(Settings(perturbation=int4.model_dump_json()), pair) == (
        None,
        None,
        "identity",
    )
    explicit = startup_profile(Settings(profile=fitting), pair)
    assert (explicit.path, explicit.source) == (fitting, f"profile {fitting}")
    # a shipped profile that does not fit (another conversion of the default model): T = 1
    other = ModelIdentity(name="other", weights_sha256="c" * 64)
    monkeypatch.setattr(
        startup,
        "DEFAULT_PAIR_PROFILE",
        _profile_for(other, ModelIdentity.perturbed(other, DEFAULT_NOISE), tmp_path / "o.json"),
    )
    with caplog.at_level(logging.WARNING):
        assert startup_profile(Settings(), pair) == (None, None, "identity")
    assert "shipped default-pair profile does not fit" in caplog.text


def test_the_shipped_default_pair_profile_tunes_every_request_temperature() -> None:
    profile = Profile.load(DEFAULT_PAIR_PROFILE)
    assert profile.perturbation == parse_spec(DEFAULT_PERTURBATION)
    assert profile.recommended_rule is not Rule.OFF
    assert profile.test_quality.row(profile.recommended_rule.value).gain > 0
    table = profile.to_policy(Rule.CALIBRATED).calibrated
    assert len(table.temperatures) == len(profile.settings.request_temperatures) == 4


def test_the_shipped_default_pair_profile_ships_the_bias_it_recommends() -> None:
    """Its bias file lies beside it (the folder serve makes a bias directory), holds the vector
    it names, one entry per token of the embedded model, and beat T = 1 on test prompts."""
    profile = Profile.load(DEFAULT_PAIR_PROFILE)
    assert profile.bias is not None
    assert profile.bias.recommended
    assert profile.to_policy().bias == profile.bias.sha256
    vector = load_bias_file(DEFAULT_PAIR_PROFILE.parent, profile.bias.sha256)
    assert vector.numel() == profile.bias.vocab_size == 49152
    assert profile.bias.test.gain > 2 * profile.bias.test.gain_stderr


def test_a_bias_that_does_not_fit_the_served_vocabulary_is_refused_at_startup(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    pair = ServedPair(tiny_model_dir, tiny_model_dir, None)
    vocab = int(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    policies = {}
    for size in (vocab, vocab + 1):
        vector = torch.randn(size)
        save_bias_file(tmp_path, vector)
        policies[size] = dataclasses.replace(TemperaturePolicy.identity(), bias=bias_sha256(vector))
    check_served_bias(policies[vocab], pair)
    check_served_bias(TemperaturePolicy.identity(), pair)
    with pytest.raises(
        ProfileError, match=rf"{vocab + 1} entries but the served model .* of {vocab} tokens"
    ):
        check_served_bias(policies[vocab + 1], pair)
    missing = dataclasses.replace(TemperaturePolicy.identity(), bias="ab" * 32)
    with pytest.raises(ProfileError, match="not available to this engine"):
        check_served_bias(missing, pair)


def test_serve_refuses_an_invalid_engine_variable_in_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(RUNTIME_NOISE_SEED_ENV, "1.5")
    monkeypatch.delitem(sys.modules, "prometheus_client", raising=False)  # put back afterwards
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with caplog.at_level(logging.ERROR, logger="noisy_temp_server.serve"):
        assert serve.run(parser.parse_args([])) == 1
    assert f"Refusing to serve: {RUNTIME_NOISE_SEED_ENV}='1.5'" in caplog.text


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_takes_plain_folders_and_refuses_bad_ones_before_the_engine_in_one_line(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = ensure_perturbed_checkpoint(tiny_model_dir, WeightNoiseSpec(scale=0.1), tmp_path)
    plain_clean = shutil.copytree(tiny_model_dir, tmp_path / "plain-clean")
    (plain_clean / MANIFEST_FILENAME).unlink()
    started: list[object] = []

    class Environment:
        trace_endpoint = "ipc://unused"

        def cleanup(self) -> None:
            pass

    monkeypatch.setattr(engine_module, "prepare_environment", lambda settings: Environment())
    monkeypatch.setattr(engine_module, "start_engine", lambda *a, **k: started.append(a))
    pair = resolve_pair(Settings(served_model=served, clean_model=plain_clean, cache_dir=tmp_path))
    assert (pair.served, pair.clean) == (served, plain_clean)
    for clean, problem in (
        (tmp_path / "missing", "no model folder"),
        (tmp_path / "plain-clean" / "config.json", "is a file, not a model folder"),
    ):
        caplog.clear()
        args = _serve_args("--served-model", str(served), "--clean-model", str(clean))
        with caplog.at_level(logging.ERROR, logger="noisy_temp_server.serve"):
            assert serve.run(args) == 1
        (line,) = [record.getMessage() for record in caplog.records]
        assert line.startswith("Refusing to serve: ")
        assert problem in line
        assert "\n" not in line
    assert started == []
