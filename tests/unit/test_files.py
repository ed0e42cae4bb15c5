"""`write_atomically`: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from noisy_temp_server.files import write_atomically


def _disk_full(descriptor: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "records.safetensors"
    write_atomically(path, b"old contents")
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, b"new contents, longer")
    assert list(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"old contents"


def test_a_write_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_atomically(path, b"first")
    write_atomically(path, b"second")
    assert list(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"second"


def test_writers_in_several_threads_each_leave_a_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    contents = [bytes([n]) * 100_000 for n in range(8)]
    threads = [threading.Thread(target=write_atomically, args=(path, c)) for c in contents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_bytes() in contents
    assert list(tmp_path.iterdir()) == [path]


def test_the_file_has_the_umasks_permissions(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        write_atomically(tmp_path / "bias", b"x")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "bias").stat().st_mode) == 0o644


def test_a_missing_folder_is_an_error_not_created(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "gone" / "file", b"x")
    assert list(tmp_path.iterdir()) == []
