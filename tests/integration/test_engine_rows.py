"""Calibrating on the engine's own rows (`scoring.engine_rows`, `calibrate --served-rows engine`),
on vLLM's CPU engine and the tiny models."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from noisy_temp_server.calibration.completions import served_rows_for
from noisy_temp_server.calibration.profile import ModelIdentity, Profile
from noisy_temp_server.commands import calibrate as calibrate_command
from noisy_temp_server.commands import kld as kld_command
from noisy_temp_server.scoring.clean_backend import InProcessModel
from noisy_temp_server.scoring.engine_rows import EngineCompletion, EngineRows, sample_with_engine
from noisy_temp_server.scoring.sequence import ScoringSequence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"
W8A8 = FIXTURES / "ct-w8a8-int8"


def _transformers_rows(folder: Path, sequence: ScoringSequence) -> torch.Tensor:
    from noisy_temp_server.checkpoints.checkpoint import load_causal_lm  # noqa: PLC0415

    model, _ = load_causal_lm(folder)
    rows = torch.cat(list(InProcessModel(model).completion_rows(sequence, 64)))
    return torch.log_softmax(rows, dim=-1)


@pytest.mark.vllm
def test_the_engine_rows_are_the_served_models_distributions_step_by_step(
    tiny_model_dir: Path,
) -> None:
    stop = 7
    ours = ("VLLM_LOGGING_STREAM", "VLLM_ENABLE_V1_MULTIPROCESSING")
    before = [os.environ.get(name) for name in ours]
    completions = sample_with_engine(
        tiny_model_dir, [[1, 2, 3], [4, 5, 6, 8]], max_new_tokens=12, seed=3, stop_token_ids={stop}
    )
    assert [os.environ.get(name) for name in ours] == before  # the engine's settings were its own
    assert [c.sequence.sequence_id for c in completions] == [0, 1]
    assert [c.sequence.prompt_length for c in completions] == [3, 4]
    for completion in completions:
        generated = completion.sequence.token_ids[completion.sequence.prompt_length :]
        assert len(generated) == 12 or generated[-1] == stop
        assert stop not in generated[:-1]
        expected = _transformers_rows(tiny_model_dir, completion.sequence)
        # the row at step s is the one token s was sampled from: transformers' row within the
        # engine's bfloat16 rounding (mean 0.03-0.04), the next step's far off (about 2)
        assert completion.rows.shape == expected.shape
        gap = (completion.rows - expected).abs().mean()
        assert gap < 0.1 < (completion.rows[1:] - expected[:-1]).abs().mean()
        assert torch.equal(completion.rows.argmax(-1), expected.argmax(-1))
        assert torch.allclose(completion.rows.logsumexp(-1), torch.zeros(len(generated)), atol=1e-5)


@pytest.mark.vllm
def test_calibrate_takes_the_engine_rows_of_a_w8a8_checkpoint_by_default(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    calibrate_command.add_arguments(parser)
    argv = [
        "--clean", str(tiny_model_dir), "--served", str(W8A8),  # auto: the engine for W8A8
        "--out", str(tmp_path / "profile.json"), "--num-prompts", "16", "--max-new-tokens", "16",
        "--validation-fraction", "0.4", "--bias-rows", "0", "--min-quality-positions", "20",
        "--min-cell-positions", "10",
    ]  # fmt: skip
    assert calibrate_command.run(parser.parse_args(argv)) == 0
    clean, served = (ModelIdentity.of_checkpoint(p) for p in (tiny_model_dir, W8A8))
    profile = Profile.load_for_pair(tmp_path / "profile.json", clean, served)
    assert profile.settings.served_rows == "engine"
    assert "Test split at" in capsys.readouterr().out


@pytest.mark.vllm
def test_kld_scores_the_engine_rows(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    kld_command.add_arguments(parser)
    argv = ["--clean", str(tiny_model_dir), "--served", str(W8A8), "--served-rows", "engine",
            "--num-prompts", "8", "--max-new-tokens", "16", "--json"]  # fmt: skip
    assert kld_command.run(parser.parse_args(argv)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["served_rows"] == "engine"
    kl = report["statistics"]["T=1"]
    assert kl["positions"] >= 100


def test_an_adapter_is_refused_on_the_engine_rows_before_any_model_work(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    calibrate_command.add_arguments(parser)
    argv = ["--clean", str(tiny_model_dir), "--served", str(W8A8), "--served-rows", "engine",
            "--adapter-rank", "4", "--out", str(tmp_path / "p.json")]  # fmt: skip
    assert calibrate_command.run(parser.parse_args(argv)) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert "the engine's rows are the served model's without an adapter" in error[0]


def test_engine_rows_serve_only_the_sequences_the_engine_sampled() -> None:
    sequence = ScoringSequence([1, 2, 3, 4], 2, 0)
    rows = torch.log_softmax(torch.randn(2, 5), dim=-1)
    backend = EngineRows([EngineCompletion(sequence, rows)])
    assert backend.vocab_size == 5
    assert torch.equal(torch.cat(list(backend.completion_rows(sequence, 1))), rows)
    with pytest.raises(ValueError, match="not one the engine sampled"):
        list(backend.completion_rows(ScoringSequence([1, 2, 3, 9], 2, 0), 1))
    with pytest.raises(ValueError, match="not one the engine sampled"):
        list(backend.completion_rows(ScoringSequence([1, 2, 3, 4], 2, 1), 1))
    with pytest.raises(ValueError, match="rows for 2 generated tokens"):
        EngineCompletion(sequence, rows[:1])


def test_auto_takes_the_engine_rows_for_w8a8_alone_and_never_with_an_adapter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def pair(folder: Path | None) -> Any:
        return SimpleNamespace(served_path=folder)

    assert served_rows_for(pair(W8A8), "auto", with_adapter=False) == "engine"
    assert not caplog.records
    assert served_rows_for(pair(W8A8), "auto", with_adapter=True) == "model"
    assert "scored with transformers' forward all the same" in caplog.text
    for other in ("ct-fp8-dynamic", "ct-gptq-w4a16", "gptq-4bit-g32"):
        assert served_rows_for(pair(FIXTURES / other), "auto", with_adapter=False) == "model"
    assert served_rows_for(pair(None), "auto", with_adapter=False) == "model"
    assert served_rows_for(pair(FIXTURES / "ct-gptq-w4a16"), "engine", with_adapter=False) == (
        "engine"
    )
