"""Every command given a bad model folder, as clean or served: one line on stderr, exit status
1, before any model work, and never a suggestion to delete the folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from noisy_temp_server.checkpoints.checkpoint import MANIFEST_FILENAME
from noisy_temp_server.cli import main

_NOISE = '{"kind": "weight_noise", "scale": 0.1}'


def _commands(good: Path, bad: Path, out: Path) -> list[list[str]]:
    return [
        ["kld", "--clean", str(good), "--served", str(bad)],
        ["kld", "--clean", str(bad), "--served", str(good)],
        ["calibrate", "--clean", str(good), "--served", str(bad), "--out", str(out)],
        ["calibrate", "--clean", str(bad), "--served", str(good), "--out", str(out)],
        ["perturb", "--clean", str(bad), "--spec", _NOISE, "--out", str(out)],
        ["quantize", "--clean", str(bad), "--format", "w4a16", "--out", str(out)],
    ]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("missing", "no model folder"),
        ("someone/not-in-the-cache", "the local Hugging Face cache holds no model"),
        ("no-config", "holds no config.json"),
    ],
)
def test_a_bad_folder_is_one_line_and_exit_status_1(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *,
    name: str,
    problem: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    if name == "no-config":
        folder = shutil.copytree(tiny_model_dir, tmp_path / name)
        (folder / MANIFEST_FILENAME).unlink()
        (folder / "config.json").unlink()
    for argv in _commands(tiny_model_dir, Path(name), tmp_path / "out"):
        assert main(argv) == 1, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith("error: "), argv
        assert problem in lines[-1], (argv, lines[-1])
        assert "rm -rf" not in lines[-1]
        assert "delete" not in lines[-1]
    assert not (tmp_path / "out").exists()
