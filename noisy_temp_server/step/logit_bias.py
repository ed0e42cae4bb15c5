"""The per-token logit bias inside the processor: how a step applies it.

A policy names its bias by content hash; the vector comes from the engine's bias directories
(`engine_contract.bias_files`). A request whose policy names a bias the engine cannot load is
refused (`check_correction`, run by the processors' ``validate_params``: HTTP 400).

`SlotBias` keeps the vectors on the device as the rows of one table ``[rows, V]``: row 0 stands
for "no bias", each correction a slot holds (a bias: one per policy version that has one) is
loaded once, on the first admission that names it, into a row of its own. A slot releases its
version when it is given to a new occupant (V1 runner: also when its request leaves the batch;
Model Runner V2 has no such hook, so a finished request's slot holds its version until vLLM
reuses the slot);
the next admission wave drops the rows no slot holds, so the table follows the versions in use.
Each admission wave writes ``weight[slot, k]`` = 1 where the slot holds row ``k + 1``, else 0.
Per step, only while some slot holds a bias (a host-side count), the versions the batch's slots
hold are found on the host (V2: from vLLM's host-side slot list of the step, a ``bincount``;
none: nothing more happens), and each is added as ``weight[:, k] * table[k + 1]`` (one
broadcast ``addcmul_`` pass over the logits per version in the batch; no ``[R, V]`` gather,
which costs several passes on a CPU). Rows without a bias get ``x + 0 * b``: every value is
unchanged (±inf and NaN included) and bit for bit too, except that a ``-0.0`` logit may come
out as ``+0.0``, which no softmax, argmax or logprob can tell apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from noisy_temp_server.correction.files import check_bias_vocabulary
from noisy_temp_server.devices import upload
from noisy_temp_server.engine_contract.bias_files import load_bias
from noisy_temp_server.engine_contract.request_args import LogitCorrection

__all__ = [
    "FILE_CORRECTIONS",
    "CorrectionSource",
    "SlotBias",
    "check_correction",
]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorrectionSource:
    """Where `SlotBias` gets the vector a correction names: ``bias(sha256)``, a float32 [V]
    tensor on the CPU; it raises ValueError when it cannot. `FILE_CORRECTIONS` (the engine's):
    the bias directories."""

    bias: Callable[[str], torch.Tensor]


FILE_CORRECTIONS = CorrectionSource(bias=load_bias)


def check_correction(correction: LogitCorrection | None) -> None:
    """ValueError unless the bias of ``correction`` (None: nothing to check) can be loaded (see
    `engine_contract.bias_files.load_bias`)."""
    if correction is not None:
        load_bias(correction.bias)


class SlotBias:
    """The corrections (per-token biases) of ``slots`` slots over a vocabulary
    of ``vocab_size`` tokens on ``device`` (see the module docstring). ``vocab_size`` None: the
    engine's vocabulary is unknown, and every bias is refused at admission. ``source``: where
    the vectors come from (the bias directories unless told).

    `stage` / `flush` follow `SlotTuning`'s admission (host staging, one copy per wave); `add`
    is the per-step hook. ``biased_slots`` counts the slots holding a bias (host side). On the
    device, as of the last flush: ``table`` [rows, V] the vectors held (row 0: zeros) and
    ``slot_rows`` [slots] int64 each slot's row of it (0: none), which the fused step
    (`fused_step`) reads in place of `add`.
    """

    def __init__(
        self,
        slots: int,
        vocab_size: int | None,
        device: torch.device,
        *,
        pin_memory: bool,
        source: CorrectionSource = FILE_CORRECTIONS,
    ) -> None:
        self.vocab_size = vocab_size
        self.source = source
        self.device = device
        self._pin = pin_memory
        self.table = torch.zeros(1, vocab_size or 0, device=device)
        self._row_of: dict[LogitCorrection, int] = {}
        self._users = [0]  # slots holding each row (row 0: unused)
        self._host_row = np.zeros(slots, dtype=np.int64)
        self.biased_slots = 0
        self._changed = False
        # As of the last flush: each slot's row, its [slots, rows - 1] 0/1 weights (column
        # k: row k + 1) and the rows' vectors (every row but 0 has a user then).
        self._flushed_row = self._host_row.copy()
        self.weight = torch.zeros(slots, 0, device=device)
        self.slot_rows = torch.zeros(slots, dtype=torch.int64, device=device)
        self._vectors: list[torch.Tensor] = []
        self._refused: set[LogitCorrection] = set()

    def stage(self, slot: int, correction: LogitCorrection | None) -> bool:
        """Give ``slot`` the bias of ``correction`` (None: none) from the next `flush` on,
        releasing the version its previous occupant held; True when it has one. A vector whose
        vocabulary is not the engine's is refused (an error is logged once per hash and the slot
        gets none): `check_correction` in ``validate_params`` cannot see the engine's
        vocabulary."""
        old = int(self._host_row[slot])
        if old:
            self._users[old] -= 1
            self.biased_slots -= 1
        row = 0 if correction is None else self._row(correction)
        if row:
            self._users[row] += 1
            self.biased_slots += 1
        self._host_row[slot] = row
        self._changed = True
        return bool(row)

    def _row(self, correction: LogitCorrection) -> int:
        """The table row of ``correction``: its row if it has one (also one released since the
        last flush), else a new row at the end with the vector loaded (0 if refused)."""
        row = self._row_of.get(correction)
        if row is not None:
            return row
        try:  # gone since validate_params, or fitted for another model: serve without it
            vector = self.source.bias(correction.bias)
            check_bias_vocabulary(vector, self.vocab_size, "the engine")
        except ValueError as error:
            return self._refuse(correction, str(error))
        row = self._row_of[correction] = len(self._users)
        self._users.append(0)
        self.table = torch.cat((self.table, vector.to(self.device).unsqueeze(0)))
        return row

    def _refuse(self, correction: LogitCorrection, why: str) -> int:
        if correction not in self._refused:
            self._refused.add(correction)
            _LOGGER.error("%s; requests naming it are served without a bias.", why)
        return 0

    def flush(self) -> None:
        """After admissions changed the slots' rows: drop the rows no slot holds any more (the
        table shrinks to row 0 and the held versions) and write the slots' weights to the device
        (one copy)."""
        if not self._changed:
            return
        self._changed = False
        if not all(self._users[1:]):
            self._drop_free_rows()
        rows = np.arange(1, len(self._users), dtype=np.int64)
        self.weight = upload(
            torch.from_numpy(self._host_row[:, None] == rows).float(), self.device, pin=self._pin
        )
        self.slot_rows = upload(torch.from_numpy(self._host_row.copy()), self.device, pin=self._pin)
        self._vectors = list(self.table[1:])
        self._flushed_row = self._host_row.copy()

    def _drop_free_rows(self) -> None:
        kept = [0] + [row for row in range(1, len(self._users)) if self._users[row]]
        renumber = np.zeros(len(self._users), dtype=np.int64)
        renumber[kept] = np.arange(len(kept))
        self.table = self.table[kept]  # a copy: the dropped rows' memory is released
        self._host_row = renumber[self._host_row]
        self._users = [self._users[row] for row in kept]
        self._row_of = {
            correction: int(renumber[row])
            for correction, row in self._row_of.items()
            if renumber[row]
        }

    def add(
        self, logits: torch.Tensor, slots: torch.Tensor, batch_slots: np.ndarray | None = None
    ) -> None:
        """Add each row's bias (if its slot has one) to ``logits`` ([R, V] float32, in place;
        ``slots``: [R] slot of each row): one pass over the logits per version held by a slot
        of the batch. Without ``batch_slots`` (the batch's slots on the host, any order and
        repeats) every held version is applied, so it suits a runner that releases the slots of
        finished requests (V1); with it, only the versions those slots hold (Model Runner V2,
        whose finished slots keep theirs until reused), and nothing when they hold none. No
        host sync."""
        if not self.biased_slots:
            return
        columns: Iterable[int] = range(len(self._vectors))
        if batch_slots is not None:
            columns = self._held_columns(self._flushed_row.take(batch_slots))
            if not columns:
                return
        weight = self.weight.index_select(0, slots)
        for column in columns:
            logits.addcmul_(weight[:, column : column + 1], self._vectors[column])

    def _held_columns(self, rows: np.ndarray) -> list[int]:
        """The weight columns of the versions among table ``rows`` (host work, no device sync)."""
        if len(self._vectors) == 1:  # the usual case: one version, nothing to count
            return [0] if rows.any() else []
        return np.flatnonzero(np.bincount(rows)[1:]).tolist()
