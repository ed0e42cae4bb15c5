"""`benchmarks/quality.py`'s external served checkpoints: `--served NAME=DIR` (repeatable), its
short form `--w8a8 DIR`, and the families a run measures by default."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest
from script_loading import load_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"


@pytest.fixture(scope="module")
def quality() -> ModuleType:
    return load_script(BENCHMARK, "quality_benchmark")


def _parsed(quality: ModuleType, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    quality.served_options(parser)
    return parser.parse_args(list(argv))


def test_served_folders_are_named_and_measured_after_the_families(quality: ModuleType) -> None:
    args = _parsed(quality, "--served", "gptq=/a/gptq", "--served", "awq=~/awq", "--w8a8", "/w")
    served = quality.served_checkpoints(args)
    assert served == [
        ("gptq", Path("/a/gptq")),
        ("awq", Path("~/awq").expanduser()),
        ("w8a8", Path("/w")),
    ]
    pairs = quality.served_pairs(["int4-g64"], served)
    assert [name for name, _ in pairs] == ["int4-g64", "gptq", "awq", "w8a8"]
    assert pairs[0][1]["spec"].group_size == 64
    assert pairs[1][1] == {"served_path": Path("/a/gptq")}


@pytest.mark.parametrize("text", ["gptq", "=/a", "gptq=", "int4=/a"])
def test_a_bad_served_argument_is_refused(quality: ModuleType, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        quality.served_argument(text)


def test_served_names_are_unique(quality: ModuleType) -> None:
    args = _parsed(quality, "--served", "w8a8=/a", "--w8a8", "/b")
    with pytest.raises(SystemExit, match="unique"):
        quality.served_checkpoints(args)


def test_int4_g64_runs_only_when_named(quality: ModuleType) -> None:
    assert "int4-g64" in quality.FAMILIES
    assert "int4-g64" not in quality.DEFAULT_FAMILIES
    assert "int4" in quality.DEFAULT_FAMILIES
