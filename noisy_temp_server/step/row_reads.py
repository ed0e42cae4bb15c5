"""How the fused step (`fused_step`) evaluates the rules that read the served row (``fisher``, a
calibrated table over the entropy), written at admission, never per step.

A slot whose rule reads the row gets, like every slot, one cell per step bucket (`slot_tables`);
the cell's value, which is T* for the other rules, is here what the step bucket selects:
``fisher``'s σ² of the bucket (negative values as 0, as `rules.fisher_temperature` takes them),
or the index of the calibrated table's row for the request's temperature band and the step
bucket (the slot's step buckets refine the table's, `reading_edges`). Per slot, `RowReads.table`
``[slots, 4]`` float32 holds (kind, parameter, entropy buckets, 0): kind 0 (T* from the cell),
`FISHER` (parameter: the policy's ``fisher_var_floor``) or `CALIBRATED` (parameter: where the
policy's entropy edges start in `RowReads.values`, its table's rows following them). `values`
holds the live calibrated policies' edges and tables, rebuilt when that set changes. The torch
path of `slot_tuning.SlotTuning.tune` reads none of this (it evaluates `policy_temperature`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

__all__ = ["CALIBRATED", "FISHER", "RowReads", "reading_edges"]

FISHER = 1
CALIBRATED = 2


def reading_edges(policy: TemperaturePolicy) -> tuple[int, ...]:
    """The step edges of a slot whose ``policy`` reads the row: the policy's, merged with its
    calibrated table's for ``calibrated``, so that each bucket lies in one bucket of each."""
    if policy.rule is Rule.CALIBRATED:
        return tuple(sorted({*policy.step_edges, *policy.calibrated.step_edges}))
    return policy.step_edges


def _band(policy: TemperaturePolicy, request_temperature: float) -> int:
    """The calibrated table's request-temperature band, as `policy_temperature` finds it."""
    edges = np.asarray(policy.calibrated.request_temperature_edges, dtype=np.float32)
    return max(int(np.searchsorted(edges, np.float32(request_temperature), side="right")) - 1, 0)


def cell_values(
    policy: TemperaturePolicy, edges: tuple[int, ...], request_temperature: float
) -> tuple[float, ...]:
    """Each step bucket's cell value (see the module docstring) for a slot of ``policy`` (which
    reads the row) with step ``edges`` (`reading_edges`)."""
    if policy.rule is Rule.FISHER:
        own = policy.step_edges
        return tuple(
            max(policy.sigma2_by_step[bisect.bisect_right(own, edge) - 1], 0.0) for edge in edges
        )
    table = policy.calibrated
    first_row = _band(policy, request_temperature) * len(table.step_edges)
    return tuple(
        float(first_row + bisect.bisect_right(table.step_edges, edge) - 1) for edge in edges
    )


def _flattened(policy: TemperaturePolicy) -> list[float]:
    """A calibrated policy's entropy edges, then its table's rows over the entropy."""
    table = policy.calibrated
    rows = [t for band in table.temperatures for row in band for t in row]
    return [*table.entropy_edges, *rows]


class RowReads:
    """The per-slot table of the rules that read the served row and the calibrated tables it
    points into (see the module docstring), for ``slots`` slots on the device; ``upload``
    copies a host array there without a sync."""

    def __init__(self, slots: int, upload: Callable[[np.ndarray], torch.Tensor]) -> None:
        self._upload = upload
        self._host = np.zeros((slots, 4), dtype=np.float32)
        self._policies: list[TemperaturePolicy | None] = [None] * slots
        self._offsets: dict[TemperaturePolicy, int] = {}
        self._dirty: set[int] = set()
        self.table = upload(self._host.copy())
        self.values = upload(np.zeros(1, dtype=np.float32))

    def assign(self, slot: int, policy: TemperaturePolicy | None) -> None:
        """``slot``'s occupant from the next `flush` on: a ``policy`` that reads the row, or
        None (its T* comes from its cells)."""
        if policy is not None or self._policies[slot] is not None:
            self._policies[slot] = policy
            self._dirty.add(slot)

    def flush(self) -> None:
        """Copy what changed to the device (the calibrated tables rebuilt when their set did)."""
        if not self._dirty:
            return
        live = {p: None for p in self._policies if p is not None and p.rule is Rule.CALIBRATED}
        if live.keys() != self._offsets.keys():
            self._offsets, values = {}, [0.0]
            for policy in live:
                self._offsets[policy] = len(values)
                values += _flattened(policy)
            self.values = self._upload(np.asarray(values, dtype=np.float32))
            self._dirty.update(np.flatnonzero(self._host[:, 0] == CALIBRATED).tolist())
        for slot in self._dirty:
            reader = self._policies[slot]
            self._host[slot] = 0.0
            if reader is not None and reader.rule is Rule.FISHER:
                self._host[slot, :2] = (FISHER, reader.fisher_var_floor)
            elif reader is not None:
                entropy_buckets = len(reader.calibrated.entropy_edges)
                self._host[slot, :3] = (CALIBRATED, self._offsets[reader], entropy_buckets)
        self._dirty.clear()
        self.table = self._upload(self._host.copy())
