"""`serve --int4-stack true`: its profile calibrated once (by calibration's own function, with
an adapter of the default rank) and cached, an interrupted calibration leaving nothing behind,
and the flags it cannot take refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from noisy_temp_server.calibration import int4_stack
from noisy_temp_server.calibration.profile import ProfileError
from noisy_temp_server.server.launch import int4_stack_settings
from noisy_temp_server.settings import Settings


def _recording(calls: list[dict[str, Any]], fail: bool = False) -> Any:
    def calibrate(clean: Path, prompts: Any, settings: Any, out: Path, **kwargs: Any) -> None:
        calls.append({"clean": clean, "settings": settings, "out": out, **kwargs})
        out.write_text("{}")
        if fail:
            raise ValueError("the served model is unusable")

    return calibrate


def test_the_stack_profile_is_calibrated_once_with_an_adapter_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(int4_stack, "calibrate_to_files", _recording(calls))
    served = tmp_path / "served" / "model-int4"
    first = int4_stack._ensure_profile(served, tmp_path / "clean", tmp_path)
    second = int4_stack._ensure_profile(served, tmp_path / "clean", tmp_path)
    assert first == second == tmp_path / "stacks" / "model-int4-r64" / "profile.json"
    (call,) = calls
    assert call["out"].parent != first.parent  # written aside, then renamed into place
    assert (call["clean"], call["served"]) == (tmp_path / "clean", served)
    assert call["settings"].adapter_rank == 64
    assert sorted(p.name for p in (tmp_path / "stacks").iterdir()) == ["model-int4-r64"]


def test_a_failed_calibration_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int4_stack, "calibrate_to_files", _recording([], fail=True))
    with pytest.raises(ValueError, match="unusable"):
        int4_stack._ensure_profile(tmp_path / "m", tmp_path / "clean", tmp_path)
    assert list((tmp_path / "stacks").iterdir()) == []


def test_a_failed_calibration_refuses_to_serve_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(cache_dir: Path) -> None:
        raise ValueError("the served model is unusable")

    monkeypatch.setattr(int4_stack, "ensure_int4_stack", fail)
    with pytest.raises(ProfileError, match="calibrating the int4 stack failed: the served"):
        int4_stack_settings(Settings(int4_stack=True, cache_dir=tmp_path))


def test_the_stack_takes_no_pair_or_profile_of_its_own(tmp_path: Path) -> None:
    assert int4_stack_settings(Settings()) == Settings()
    settings = Settings(int4_stack=True, profile=tmp_path / "p.json", adapter=tmp_path)
    with pytest.raises(ProfileError, match="drop --profile, --adapter"):
        int4_stack_settings(settings)
