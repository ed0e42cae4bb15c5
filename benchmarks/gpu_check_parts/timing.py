"""How `gpu_check.py` and its parts time work on a device: CUDA events on a GPU, the wall clock
on a CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_WARM_UP_CALLS = 2


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    run: Callable[[], Any], reset: Callable[[], Any], device: torch.device, repeats: int
) -> tuple[float, float]:
    """(device µs, host µs) of ``run``: medians over ``repeats`` calls, each after an untimed
    ``reset`` and an idle device, after two warm-up calls. Device time: CUDA events around the
    call (on a CPU, its wall time); host time: the wall time until the call returns."""
    for _ in range(_WARM_UP_CALLS):
        reset()
        run()
    device_times, host_times = [], []
    for _ in range(repeats):
        reset()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        run()
        host_times.append((time.perf_counter() - started) * 1e6)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            device_times.append(start.elapsed_time(end) * 1e3)
        else:
            device_times.append(host_times[-1])
    return statistics.median(device_times), statistics.median(host_times)
