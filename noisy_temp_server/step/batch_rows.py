"""Per-row state of a batch, kept in preallocated CPU arrays, free of vLLM.

Columns are numpy arrays (views of CPU torch tensors) plus plain Python lists for objects (e.g.
the reference to a request's growing output-token list). A row is live iff ``active[row]``; a
freed row's values are stale and never read. `vllm_plugin.batch_rows` applies vLLM's
``BatchUpdate`` protocol (removed → added → moved) to these columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RowColumns"]


class RowColumns:
    """``capacity`` rows of typed array columns and object columns, and which rows are live."""

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
        tensor = torch.full((self.capacity,), fill, dtype=dtype)
        view = tensor.numpy()
        self._arrays.append(view)
        return tensor, view

    def objects(self) -> list[Any]:
        """Add an object column: a list of ``capacity`` Nones."""
        column: list[Any] = [None] * self.capacity
        self._objects.append(column)
        return column

    def activate(self, row: int) -> None:
        """Mark ``row`` live (its columns written by the caller)."""
        self.n_active += not self.active[row]
        self.active[row] = True

    def free(self, row: int) -> bool:
        """Mark ``row`` free (its object columns let go); whether it was live."""
        if not self.active[row]:
            return False
        self.active[row] = False
        self.n_active -= 1
        for column in self._objects:
            column[row] = None
        return True

    def move(self, a: int, b: int, *, swap: bool) -> bool:
        """Swap rows ``a`` and ``b`` (``swap``), or move ``a`` to ``b`` one way (``b`` takes
        ``a``'s state, replacing its own, and ``a`` is freed); whether a live row changed."""
        a_active, b_active = bool(self.active[a]), bool(self.active[b])
        if not (a_active or b_active):
            return False
        if swap:
            for array in self._arrays:
                array[a], array[b] = array[b], array[a]
            for column in self._objects:
                column[a], column[b] = column[b], column[a]
            return True
        for array in self._arrays:
            array[b] = array[a]
        for column in self._objects:
            column[b] = column[a]
        self.active[a] = False
        self.n_active -= b_active
        for column in self._objects:
            column[a] = None
        return True
