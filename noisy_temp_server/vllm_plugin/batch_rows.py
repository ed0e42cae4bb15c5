"""vLLM's persistent batch (V1 model runner) applied to `step.batch_rows.RowColumns`.

vLLM tells a logits processor how its batch changed through a `BatchUpdate`: rows removed,
requests added at an index (possibly replacing a row), and rows moved within the batch, to be
processed in the order removed → added → moved (see
``vllm/v1/sample/logits_processor/interface.py``). `apply_batch_update` applies that protocol
to a set of columns, once, so each processor only says how a request becomes a row
(`RowAdmission`).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from noisy_temp_server.step.batch_rows import RowColumns

__all__ = ["BatchRows", "RowAdmission", "apply_batch_update"]

# (row, params, output_token_ids) -> False when the request needs no state (the row is freed),
# True after writing the row's columns.
RowAdmission = Callable[[int, SamplingParams, list[int]], bool]


def apply_batch_update(
    rows: RowColumns, batch_update: BatchUpdate | None, admit: RowAdmission
) -> bool:
    """Apply one `BatchUpdate` (removed → added → moved) to ``rows``. Returns whether any live
    row changed.

    ``admit(row, params, output_token_ids)`` writes the new request's columns at ``row`` and
    returns True, or returns False when the request needs no state here.
    """
    if batch_update is None:
        return False
    changed = False
    for row in batch_update.removed:
        changed |= rows.free(row)
    for row, params, _prompt_ids, output_ids in batch_update.added:
        if admit(row, params, output_ids):
            rows.activate(row)
            changed = True
        else:
            changed |= rows.free(row)
    for a, b, direction in batch_update.moved:
        changed |= rows.move(a, b, swap=direction == MoveDirectionality.SWAP)
    return changed


class BatchRows(RowColumns):
    """``capacity`` rows (vLLM's ``max_num_seqs``) that follow vLLM's persistent batch."""

    def update(self, batch_update: BatchUpdate | None, admit: RowAdmission) -> bool:
        """`apply_batch_update` to these rows."""
        return apply_batch_update(self, batch_update, admit)
