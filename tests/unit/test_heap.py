"""The glibc mmap threshold fix for the online estimator's refits, observed through glibc's
own accounting (``mallinfo2().hblkhd``: bytes in mmapped blocks) in a fresh process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, sys
from noisy_temp_server.online.heap import fix_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
size = 4 << 20
libc.free(libc.malloc(size))  # with a dynamic threshold, this raises it past 4 MiB
before = libc.mallinfo2().hblkhd
block = libc.malloc(size)
print(libc.mallinfo2().hblkhd - before >= size)
libc.free(block)
"""


def _second_block_is_mapped(mode: str) -> bool:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return run.stdout.strip() == "True"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_large_blocks_stay_mapped_after_one_was_freed() -> None:
    assert not _second_block_is_mapped("dynamic")  # glibc's default: the heap serves it
    assert _second_block_is_mapped("fixed")
