"""Keep glibc's heap from growing under the online estimator's refits.

Each refit concatenates the estimator's window (about 9 MB at 50 000 positions) and fits on
it: large, short-lived tensors. glibc serves an allocation above its mmap threshold with its
own mapping, returned to the system when freed, but the threshold is *dynamic*: once a large
mapped block is freed, the threshold rises past it, later blocks of that size come from the
heap, and the heap fragments. `experiments/estimator_heap.py` measures it (with and without
``--fixed``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["fix_mmap_threshold"]

_LOGGER = logging.getLogger(__name__)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process, which also turns
    its dynamic adjustment off (``mallopt(M_MMAP_THRESHOLD)``). Returns whether it was set;
    False (and nothing changed) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        _LOGGER.debug("no mallopt in the C library (%s); the mmap threshold stays dynamic", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
