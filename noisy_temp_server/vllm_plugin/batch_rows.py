"""Per-row state of vLLM's persistent batch, kept in preallocated CPU arrays.

vLLM (V1 model runner) tells a logits processor how its batch changed through a `BatchUpdate`:
rows removed, requests added at an index (possibly replacing a row), and rows moved within the
batch, to be processed in the order removed → added → moved (see
``vllm/v1/sample/logits_processor/interface.py``). `BatchRows` applies that protocol to a set of
columns, once, so each processor only says how a request becomes a row (`RowAdmission`).

Columns are numpy arrays (views of CPU torch tensors) plus plain Python lists for objects (e.g.
the reference to a request's growing output-token list). A row is live iff ``active[row]``; a
freed row's values are stale and never read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

__all__ = ["BatchRows", "RowAdmission"]

# (row, params, output_token_ids) -> False when the request needs no state (the row is freed),
# True after writing the row's columns.
RowAdmission = Callable[[int, SamplingParams, list[int]], bool]


class BatchRows:
    """``capacity`` rows (vLLM's ``max_num_seqs``) of typed array columns and object columns."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"batch capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._arrays: list[np.ndarray[Any, Any]] = []
        self._objects: list[list[Any]] = []
        _, self.active = self.array(torch.bool)
        self.n_active = 0

    def array(
        self, dtype: torch.dtype, fill: float = 0
    ) -> tuple[torch.Tensor, np.ndarray[Any, Any]]:
        """Add a column: a CPU tensor of ``capacity`` values and its numpy view (shared memory)."""
        tensor = torch.full(
            (self.capacity,),
            fill,
            dtype=dtype,
        )
        view = tensor.numpy()
        self._arrays.append(view)
        return tensor, view

    def objects(self) -> list[Any]:
        """Add an object column: a list of ``capacity`` Nones."""
        column: list[Any] = [None] * self.capacity
        self._objects.append(column)
        return column

    def update(self, batch_update: BatchUpdate | None, admit: RowAdmission) -> bool:
        """Apply one `BatchUpdate` (removed → added → moved). Returns whether any live row changed.

        ``admit(row, params, output_token_ids)`` writes the new request's columns at ``row`` and
        returns True, or returns False when the request needs no state here.
        """
        if batch_update is None:
            return False
        changed = False
        for row in batch_update.removed:
            changed |= self._free(row)
        for row, params, _prompt_ids, output_ids in batch_update.added:
            was_active = bool(self.active[row])
            if admit(row, params, output_ids):
                self.active[row] = True
                self.n_active += not was_active
                changed = True
            else:
                changed |= self._free(row)
        for a, b, direction in batch_update.moved:
            changed |= self._move(a, b, swap=direction == MoveDirectionality.SWAP)
        return changed

    def _free(self, row: int) -> bool:
        if not self.active[row]:
            return False
        self.active[row] = False
        self.n_active -= 1
        for column in self._objects:
            column[row] = None
        return True

    def _move(self, a: int, b: int, *, swap: bool) -> bool:
        a_active, b_active = bool(self.active[a]), bool(self.active[b])
        if not (a_active or b_active):
            return False
        if swap:
            for array in self._arrays:
                array[a], array[b] = array[b], array[a]
            for column in self._objects:
                column[a], column[b] = column[b], column[a]
            return True
        # One-way a -> b: b takes a's state (replacing b's), a is freed.
        for array in self._arrays:
            array[b] = array[a]
        for column in self._objects:
            column[b] = column[a]
        self.active[a] = False
        self.n_active -= b_active
        for column in self._objects:
            column[a] = None
        return True
