"""`serve --int4-stack true`: its profile calibrated once and cached, an interrupted
calibration leaving nothing behind, and the flags it cannot take refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from noisy_temp_server.calibration.profile import ProfileError
from noisy_temp_server.commands import serve_stack
from noisy_temp_server.settings import Settings


def test_the_stack_profile_is_calibrated_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def calibrate(served: Path, clean: Path, cache_dir: Path, out: Path) -> None:
        calls.append(out)
        out.write_text("{}")

    monkeypatch.setattr(serve_stack, "_calibrate", calibrate)
    served = tmp_path / "served" / "model-int4"
    first = serve_stack.ensure_stack_profile(served, tmp_path / "clean", tmp_path)
    second = serve_stack.ensure_stack_profile(served, tmp_path / "clean", tmp_path)
    assert first == second == tmp_path / "stacks" / "model-int4-r64" / "profile.json"
    assert len(calls) == 1
    assert calls[0].parent != first.parent  # written aside, then renamed into place
    assert sorted(p.name for p in (tmp_path / "stacks").iterdir()) == ["model-int4-r64"]


def test_a_failed_calibration_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def calibrate(served: Path, clean: Path, cache_dir: Path, out: Path) -> None:
        out.write_text("partial")
        raise ProfileError("calibrating the int4 stack failed")

    monkeypatch.setattr(serve_stack, "_calibrate", calibrate)
    with pytest.raises(ProfileError, match="failed"):
        serve_stack.ensure_stack_profile(tmp_path / "m", tmp_path / "clean", tmp_path)
    assert list((tmp_path / "stacks").iterdir()) == []


def test_the_stack_takes_no_pair_or_profile_of_its_own(tmp_path: Path) -> None:
    assert serve_stack.stack_settings(Settings()) == Settings()
    settings = Settings(int4_stack=True, profile=tmp_path / "p.json", adapter=tmp_path)
    with pytest.raises(ProfileError, match="drop --profile, --adapter"):
        serve_stack.stack_settings(settings)


def test_the_stack_calibrates_its_pair_with_a_rank_64_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from noisy_temp_server.commands import calibrate  # noqa: PLC0415

    given: list[Any] = []

    def run(args: Any) -> int:
        given.append(args)
        args.out.write_text("{}")
        return 0

    monkeypatch.setattr(calibrate, "run", run)
    out = tmp_path / "profile.json"
    serve_stack._calibrate(tmp_path / "int4", tmp_path / "clean", tmp_path, out)
    (args,) = given
    assert (args.served, args.clean, args.out) == (tmp_path / "int4", tmp_path / "clean", out)
    assert args.adapter_rank == serve_stack.STACK_ADAPTER_RANK == 64
    monkeypatch.setattr(calibrate, "run", lambda args: 1)
    with pytest.raises(ProfileError, match="calibrating the int4 stack failed"):
        serve_stack._calibrate(tmp_path / "int4", tmp_path / "clean", tmp_path, tmp_path / "x")
