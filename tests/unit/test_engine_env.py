"""`engine_contract.engine_env`: the engine's configuration, written once by the server and read
once by the engine side."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from noisy_temp_server.engine_contract import keys
from noisy_temp_server.engine_contract.bias_files import bias_directories
from noisy_temp_server.engine_contract.engine_env import BOOLEAN_WORDS, EngineConfig, engine_config
from noisy_temp_server.engine_contract.request_args import default_policy_json, parse_request_args
from noisy_temp_server.engine_contract.trace_sender import TraceSender
from noisy_temp_server.settings import Settings, add_settings_arguments
from noisy_temp_server.step.capture import CaptureBounds
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.runtime_noise import RuntimeLogitNoiseProcessor

_PACKAGE = Path(__file__).resolve().parents[2] / "noisy_temp_server"
_READS_ENVIRONMENT = re.compile(r"os\.environ|getenv\(|environ\.get\(")
_EVERY_FIELD_SET = EngineConfig(
    trace_endpoint="ipc:///tmp/nts-test.sock",
    bias_dirs=(Path("/biases"), Path("/profiles/int4")),
    policy_file=Path("/profiles/int4.json"),
    runtime_noise_sigma=0.1,
    runtime_noise_seed=-3,
    capture_rows_per_step=2,
    capture_positions=33,
    capture_queue_rows=5,
    fused_step=False,
)


@pytest.fixture
def engine_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Every engine variable unset, and restored after the test (whatever the test writes)."""
    for name in keys.ENGINE_ENV_NAMES:
        monkeypatch.setenv(name, "")  # recorded, so that the teardown restores it
        monkeypatch.delenv(name)
    return monkeypatch


def test_a_configuration_round_trips_through_the_environment() -> None:
    written = _EVERY_FIELD_SET.to_environ()
    assert set(written) == set(keys.ENGINE_ENV_NAMES)
    assert EngineConfig.from_environ(written) == _EVERY_FIELD_SET
    assert EngineConfig().to_environ() == {}
    assert EngineConfig.from_environ({}) == EngineConfig()


def test_apply_writes_the_configuration_whole() -> None:
    environ = {keys.BIAS_DIR_ENV: "/stale", keys.POLICY_FILE_ENV: "/old.json", "PATH": "/bin"}
    EngineConfig(trace_endpoint="tcp://127.0.0.1:5555", capture_positions=7).apply(environ)
    assert environ == {
        keys.TRACE_ENDPOINT_ENV: "tcp://127.0.0.1:5555",
        keys.CAPTURE_POSITIONS_ENV: "7",
        "PATH": "/bin",
    }


def test_empty_values_and_empty_folders_mean_the_defaults() -> None:
    environ = dict.fromkeys(keys.ENGINE_ENV_NAMES, " ")
    assert EngineConfig.from_environ(environ) == EngineConfig()
    listed = {keys.BIAS_DIR_ENV: f"{os.pathsep}/a {os.pathsep}{os.pathsep}/b{os.pathsep}"}
    assert EngineConfig.from_environ(listed).bias_dirs == (Path("/a"), Path("/b"))


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        (keys.RUNTIME_NOISE_SIGMA_ENV, "-1"),
        (keys.RUNTIME_NOISE_SIGMA_ENV, "inf"),
        (keys.RUNTIME_NOISE_SIGMA_ENV, "loud"),
        (keys.RUNTIME_NOISE_SEED_ENV, "1.5"),
        (keys.CAPTURE_ROWS_PER_STEP_ENV, "0"),
        (keys.CAPTURE_POSITIONS_ENV, "many"),
        (keys.CAPTURE_QUEUE_ROWS_ENV, "-4"),
        (keys.FUSED_STEP_ENV, "maybe"),
    ],
)
def test_an_invalid_value_is_refused_naming_its_variable(variable: str, value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(variable)):
        EngineConfig.from_environ({variable: value})


@pytest.mark.parametrize("word", sorted(BOOLEAN_WORDS))
def test_every_channel_reads_the_one_list_of_boolean_words(word: str) -> None:
    meaning = BOOLEAN_WORDS[word]
    assert EngineConfig.from_environ({keys.FUSED_STEP_ENV: word.upper()}).fused_step is meaning
    assert parse_request_args({keys.KEY_TRACE: f" {word} "}).trace is meaning
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ["fused_step"])
    assert parser.parse_args(["--fused-step", word]).setting_fused_step is meaning


def test_a_bias_folder_that_cannot_be_listed_is_refused() -> None:
    with pytest.raises(ValueError, match=keys.BIAS_DIR_ENV):
        EngineConfig(bias_dirs=(Path(f"/a{os.pathsep}b"),))


def test_the_capture_and_step_variables_are_the_settings_of_the_same_names() -> None:
    for name in ("capture_rows_per_step", "capture_positions", "capture_queue_rows", "fused_step"):
        assert f"NTS_{name.upper()}" in keys.ENGINE_ENV_NAMES
        assert getattr(EngineConfig(), name) == Settings.model_fields[name].default


def test_engine_config_follows_the_environment(
    engine_environment: pytest.MonkeyPatch,
) -> None:
    assert engine_config() == EngineConfig()
    engine_environment.setenv(keys.CAPTURE_QUEUE_ROWS_ENV, "3")
    assert engine_config() == EngineConfig(capture_queue_rows=3)
    assert engine_config() is engine_config()  # parsed once per set of values


def test_the_engine_side_reads_its_values_from_the_configuration(
    engine_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    policy = TemperaturePolicy.identity().with_overrides(rule=Rule.SQRT)
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(policy.to_json(), encoding="utf-8")
    written = EngineConfig(
        trace_endpoint="tcp://127.0.0.1:5999",
        bias_dirs=(tmp_path / "a", tmp_path / "b"),
        policy_file=policy_file,
        runtime_noise_sigma=0.25,
        runtime_noise_seed=7,
        capture_rows_per_step=3,
        capture_positions=5,
        capture_queue_rows=9,
    )
    written.apply(os.environ)
    sender = TraceSender.from_env()
    assert sender is not None
    assert sender.endpoint == "tcp://127.0.0.1:5999"
    sender.close()
    assert bias_directories() == (tmp_path / "a", tmp_path / "b")
    assert TemperaturePolicy.from_json(default_policy_json()) == policy
    assert CaptureBounds.from_engine_config(engine_config()) == CaptureBounds(3, 5, 9)
    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    noise = RuntimeLogitNoiseProcessor(vllm_config, torch.device("cpu"), False)  # type: ignore[arg-type]
    assert noise.default_sigma == 0.25
    assert noise._generator.initial_seed() == 7


def test_no_other_module_reads_the_engine_variables() -> None:
    names = {*keys.ENGINE_ENV_NAMES, *(n for n in keys.__all__ if n.endswith("_ENV"))}
    readers = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.name in ("engine_env.py", "keys.py"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _READS_ENVIRONMENT.search(line) and any(n in line for n in names):
                readers.append(f"{path.relative_to(_PACKAGE)}:{number}: {line.strip()}")
    assert readers == []


def test_the_architecture_table_lists_exactly_the_engine_variables() -> None:
    document = (_PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = document.split("### Engine variables", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`(NTS_\w+)`", row.split("|")[1])}
    assert listed == set(keys.ENGINE_ENV_NAMES)
