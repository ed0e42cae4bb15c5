"""`kld` end to end on the tiny model: table, JSON, T* from --t and from a profile, refusal."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from profile_helpers import sample_bias, sample_profile
from transformers import AutoConfig

from noisy_temp_server.adapter.layer_fit import fit_compensation_adapter
from noisy_temp_server.adapter.lora import (
    adapter_folder_name,
    adapter_sha256,
    save_peft_adapter,
)
from noisy_temp_server.calibration.profile import (
    AdapterSummary,
    BiasSummary,
    ModelIdentity,
    Profile,
)
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.cli import build_parser
from noisy_temp_server.commands import kld as kld_command
from noisy_temp_server.commands import perturb as perturb_command
from noisy_temp_server.correction.files import bias_sha256, save_bias_file
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.rules import Rule

SPEC = '{"kind": "quantization", "format": "int4", "group_size": 16}'


def _run(module: object, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return int(module.run(parser.parse_args(argv)))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def served_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kld") / "served"
    argv = ["--spec", SPEC, "--out", str(out), "--clean", str(tiny_model_dir)]
    assert _run(perturb_command, argv) == 0
    return out


def _pair(tiny_model_dir: Path, served_dir: Path) -> list[str]:
    return ["--clean", str(tiny_model_dir), "--served", str(served_dir), "--num-prompts", "8"]


def test_kld_prints_the_table_and_writes_json(
    tiny_model_dir: Path, served_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kld.json"
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "24", "--t", "1.3"]
    assert _run(kld_command, [*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("Mean KLD", "99.9% KLD", "1% KLD", "RMS Δp", "Same top p", "PPL(served)/PPL"):
        assert line in printed
    assert "T* (fixed, mean 1.300)" in printed
    report = json.loads(out.read_text())
    t_one, t_star = report["statistics"]["T=1"], report["statistics"]["T*"]
    assert t_one["positions"] == t_star["positions"] >= 100
    assert t_one["sequences"] == 8
    assert t_one["kld_mean"] > 0
    assert t_one["kld_stderr"] > 0
    assert t_one["kld_mean"] != t_star["kld_mean"]
    assert t_one["same_top_rate"] == t_star["same_top_rate"]  # T never changes the argmax
    assert report["mean_t_star"] == pytest.approx(1.3)
    assert report["scored_tokens_per_second"] > 0

    assert _run(kld_command, [*argv, "--json"]) == 0
    printed_json = json.loads(capsys.readouterr().out)
    assert printed_json["statistics"]["T=1"] == t_one  # scoring is deterministic


def test_kld_takes_t_star_from_a_profile(
    tiny_model_dir: Path, served_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    identities = {p: ModelIdentity.of_checkpoint(p) for p in (tiny_model_dir, served_dir)}
    sample_profile(Rule.CALIBRATED).model_copy(
        update={"clean": identities[tiny_model_dir], "served": identities[served_dir]}
    ).save(profile)
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "24", "--json"]
    argv += ["--profile", str(profile)]
    assert _run(kld_command, argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy"]["rule"] == "calibrated"
    assert 0.9 < report["mean_t_star"] < 1.1  # the table's entries are 0.9, 1.0 and 1.1
    assert _run(kld_command, [*argv, "--rule", "fixed"]) == 0
    assert json.loads(capsys.readouterr().out)["mean_t_star"] == pytest.approx(0.9)

    other = tmp_path / "other.json"
    sample_profile().save(other)  # made for another pair
    assert _run(kld_command, [*argv[:-1], str(other)]) == 1
    assert "profile" in capsys.readouterr().err
    assert _run(kld_command, [*_pair(tiny_model_dir, served_dir), "--rule", "fixed"]) == 1
    assert "--profile" in capsys.readouterr().err


def test_kld_refuses_too_few_positions(
    tiny_model_dir: Path, served_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "4"]
    assert _run(kld_command, argv) == 1
    assert "the scoreboard needs at least 100" in capsys.readouterr().err


def test_kld_is_a_subcommand() -> None:
    args = build_parser().parse_args(["kld", "--t", "1.2", "--json"])
    assert args.run is kld_command.run


def test_kld_serves_the_profiles_bias_before_t_star(
    tiny_model_dir: Path, served_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vocab = int(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    base = sample_profile(Rule.FIXED)
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "24", "--json"]
    statistics = {}
    for name, vector in (("zero", torch.zeros(vocab)), ("random", 3 * torch.randn(vocab))):
        save_bias_file(tmp_path, vector)
        summary = sample_bias(base, bias_sha256(vector), vocab)
        profile = tmp_path / f"{name}.profile.json"
        _save_for_pair(base, summary, (tiny_model_dir, served_dir), profile)
        assert _run(kld_command, [*argv, "--profile", str(profile)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["policy"]["bias"] == summary.sha256
        statistics[name] = report["statistics"]
    for name in ("kld_mean", "same_top_rate", "delta_p_mean", "ln_ppl_ratio"):  # b = 0, T = 1
        assert statistics["zero"]["T*"][name] == pytest.approx(statistics["zero"]["T=1"][name])
    served, at_one = statistics["random"]["T*"], statistics["random"]["T=1"]
    assert served["kld_mean"] > at_one["kld_mean"] + 0.1  # a random bias pulls q away from p
    assert served["same_top_rate"] != at_one["same_top_rate"]  # and moves the argmax


def test_kld_refuses_a_profile_whose_bias_sits_on_a_head_map_in_one_line(
    tiny_model_dir: Path, served_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile an earlier version wrote with a head map under its bias (head maps were
    removed): its bias was fitted on mapped rows, so it is refused, not served without it."""
    vector = torch.zeros(int(AutoConfig.from_pretrained(tiny_model_dir).vocab_size))
    save_bias_file(tmp_path, vector)
    base = sample_profile(Rule.FIXED)
    profile = tmp_path / "mapped.profile.json"
    _save_for_pair(
        base,
        sample_bias(base, bias_sha256(vector), vector.numel()),
        (tiny_model_dir, served_dir),
        profile,
    )
    document = json.loads(profile.read_text())
    document["bias"].update(head_map="cd" * 32, head_map_rank=2, head_map_penalty=1.0)
    profile.write_text(json.dumps(document))
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "24"]
    assert _run(kld_command, [*argv, "--profile", str(profile)]) == 1
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "head map under its bias, which noisy-temp-server no longer serves" in error
    assert "recalibrate" in error


def _save_for_pair(
    profile: Profile, bias: BiasSummary, pair: tuple[Path, Path], path: Path
) -> None:
    """Save `profile` with `bias`, as calibrated on the checkpoints `pair` (clean, served)."""
    clean, served = (ModelIdentity.of_checkpoint(p) for p in pair)
    profile.model_copy(update={"clean": clean, "served": served, "bias": bias}).save(path)


def test_kld_table_header_keeps_its_column_titles_apart(
    tiny_model_dir: Path, served_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "24", "--t", "1.3"]
    assert _run(kld_command, argv) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "T* (" in line)
    assert header.split()[:2] == ["T=1", "T*"]


def test_kld_shows_each_layer_of_a_stack_with_an_adapter(
    tiny_model_dir: Path, served_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile naming a recommended adapter (fitted here on the tiny int4 pair): the served
    model samples and is scored with it, and the table has the served model at T = 1, the
    adapter alone and adapter + T, each with its share removed and greedy agreement."""
    clean, _ = load_causal_lm(tiny_model_dir)
    served, _ = load_causal_lm(served_dir)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        ScoringSequence(torch.randint(3, 500, (48,), generator=generator).tolist(), 8, i)
        for i in range(8)
    ]
    adapter = fit_compensation_adapter(clean, served, sequences, rank=16)
    save_peft_adapter(tmp_path, adapter)
    base = sample_profile(Rule.FIXED)
    summary = AdapterSummary(
        sha256=adapter_sha256(adapter),
        rank=16,
        target_modules=tuple(adapter.target_modules),
        layers=len(adapter.layers),
        method="eora",
        ridge=0.01,
        recommended=True,
        validation=base.test_quality.rows[0],
        test=base.test_quality.rows[0],
    )
    identities = {"clean": ModelIdentity.of_checkpoint(tiny_model_dir)}
    identities["served"] = ModelIdentity.of_checkpoint(served_dir)
    profile = tmp_path / "p.profile.json"
    base.model_copy(update={**identities, "adapter": summary}).save(profile)
    argv = [*_pair(tiny_model_dir, served_dir), "--max-new-tokens", "24", "--profile"]
    assert _run(kld_command, [*argv, str(profile), "--greedy-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "The stack (adapter" in printed
    assert _run(kld_command, [*argv, str(profile), "--json"]) == 0
    stack = json.loads(capsys.readouterr().out)["stack"]
    labels = [layer["label"] for layer in stack]
    assert labels == ["served, T=1", "adapter, T=1", "adapter + T (fixed)"]
    assert stack[0]["share_removed"] == 0
    assert stack[1]["share_removed"] > 0.2
    assert [layer["greedy"]["prompts"] for layer in stack] == [8, 8, 8]
    (tmp_path / adapter_folder_name(summary.sha256) / "adapter_model.safetensors").unlink()
    assert _run(kld_command, [*argv, str(profile)]) == 1
    assert "adapter_model.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("fixture", ["ct-gptq-w4a16", "gptq-4bit-g32"])
def test_kld_scores_a_packed_served_model_as_the_whole_loaded_one(
    tiny_model_dir: Path, fixture: str, capsys: pytest.CaptureFixture[str]
) -> None:
    served = Path(__file__).resolve().parents[1] / "fixtures" / "quantized" / fixture
    argv = ["--clean", str(tiny_model_dir), "--served", str(served), "--num-prompts", "8"]
    statistics = {}
    for weights in ("packed", "float"):
        command = [*argv, "--max-new-tokens", "24", "--json", "--served-weights", weights]
        assert _run(kld_command, command) == 0
        statistics[weights] = json.loads(capsys.readouterr().out)["statistics"]["T=1"]
    packed, whole = statistics["packed"], statistics["float"]
    assert packed["positions"] == whole["positions"]
    assert packed["kld_mean"] > 0
    assert packed["kld_mean"] == pytest.approx(whole["kld_mean"], rel=1e-4)
