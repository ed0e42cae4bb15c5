"""The processors' step reads nothing of the device's data on the host, under both runners.

On a GPU such a read (``.item()``, ``bool(t)``, a data-dependent shape such as ``nonzero`` or a
boolean mask) waits for the device: the step's promise is that none happens. The CUDA test in
`test_processor_v2.py` checks it with CUDA's own sync detector where a GPU is present; this one
runs everywhere and watches the dispatcher for the operations that read device data on the
host, with every kind of row in one batch: a step-only rule, a rule that reads the served row
(fisher), a per-token bias, a traced request, a captured one and an untuned one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_logit_bias import (
    _add_v1,
    _bias,
    _clean_env,  # noqa: F401  (autouse: the processors' environment)
    _logits,
    _params,
    _v1,
    _v2,
)
from test_processor_v2 import _Batch, _ctx
from torch.utils._python_dispatch import TorchDispatchMode

from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, TRACE_ENDPOINT_ENV
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

_aten = torch.ops.aten
_HOST_READS = {
    _aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten.bincount.default,
}
LINEAR = TemperaturePolicy(
    rule=Rule.LINEAR, step_edges=(0, 3), alpha_by_step=(0.5, 0.25), sigma2_by_step=(0.0, 0.0)
)
FISHER = TemperaturePolicy(rule=Rule.FISHER, alpha_by_step=(0.5,), sigma2_by_step=(0.2,))


class _HostReads(TorchDispatchMode):
    """Records the aten operations that read device data on the host: those in `_HOST_READS`,
    a boolean mask used as an index, and `repeat_interleave` without its output size."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_READS or _masks(func, args) or _sized_by_data(func, kwargs):
            self.reads.append(str(func))
        return func(*args, **kwargs)


def _masks(func: Any, args: Any) -> bool:
    if func not in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _sized_by_data(func: Any, kwargs: dict[str, Any]) -> bool:
    return func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None


@pytest.fixture
def biased_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A policy serving a bias; the trace channel (traces and captured rows) is live too."""
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    _, sha = _bias(tmp_path)
    with TraceCollector(f"ipc://{tmp_path}/trace.sock") as collector:
        monkeypatch.setenv(TRACE_ENDPOINT_ENV, collector.endpoint)
        yield dataclasses.replace(LINEAR, bias=sha).to_json()


def _requests(biased_policy: str) -> list[Any]:
    return [
        _params(0.8, nts_policy=LINEAR.to_json(), nts_trace_id="traced", nts_trace=True),
        _params(1.0, nts_policy=FISHER.to_json(), nts_trace_id="captured", nts_capture=True),
        _params(1.0, nts_policy=biased_policy),
        _params(1.0, nts_tune=False),
    ]


def _reads_of(step: Any) -> list[str]:
    step()  # warm-up: allocations and first-use caches may read
    with _HostReads() as watch:
        step()
    return watch.reads


def test_the_detector_sees_a_host_read() -> None:
    with _HostReads() as watch:
        logits = torch.randn(2, 5)
        if bool((logits > 10).any()):
            pass
        logits[logits > 0] = 0
    assert len(watch.reads) == 2


def test_a_v1_step_reads_nothing_on_the_host(biased_policy: str) -> None:
    processor = _v1()
    _add_v1(processor, *enumerate(_requests(biased_policy)))
    assert processor.capture.active
    logits = _logits(4)
    assert _reads_of(lambda: processor.apply(logits.clone())) == []


def test_a_v2_step_reads_nothing_on_the_host(biased_policy: str) -> None:
    processor = _v2(_Batch([2] * 6))
    for slot, params in enumerate(_requests(biased_policy)):
        processor.add_request(slot, params)
    processor.apply_staged_writes()
    assert processor.capture.active
    logits = _logits(5)
    context = _ctx([(0, 2), (1, 3), (2, 2), (3, 4), (0, 3)])
    assert _reads_of(lambda: processor.apply(logits.clone(), context)) == []
