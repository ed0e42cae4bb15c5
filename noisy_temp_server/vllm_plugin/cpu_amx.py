"""Let the engine's CPU kernels use AMX: Linux hands a process the AMX tile state only after it
asks (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); an AMX instruction before that
is an illegal instruction. oneDNN asks before its own AMX kernels, but some of vLLM 0.32's CPU
kernels do not: on a host with AMX, the tiny test Llama in bfloat16 killed the engine worker
with SIGILL on its first request (the embedded SmolLM2 served on the same host; why is not
known). The processors ask once per worker process, at construction.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

__all__ = ["request_amx_permission"]

_ARCH_PRCTL = 158  # x86_64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_LOGGER = logging.getLogger(__name__)


def _has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return " amx_tile" in flags


def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile state for this process when the CPU has AMX; True when
    granted (asking again is harmless), False on other hosts or when refused (logged)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not _has_amx():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        _LOGGER.warning("the kernel refused AMX to this process (errno %d)", ctypes.get_errno())
        return False
    return True
