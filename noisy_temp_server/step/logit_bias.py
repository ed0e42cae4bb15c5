"""The per-token logit bias (and the head map under it) inside the processor: where they come
from and how a step applies them.

A policy names its bias by content hash (`TemperaturePolicy.bias`); the vector is the file
``bias_file_name(sha256)`` (`correction.files.save_bias_file`) in one of the engine's
*bias directories*: ``$NTS_BIAS_DIR``, a search path of folders separated by ``os.pathsep``
(``:``) looked up in order (safe, since the name is the content hash), else the folder of
``$NTS_POLICY_FILE`` when that policy names a bias (`calibrate` writes the two side by side).
Without either no bias is possible, and a request whose policy names one is refused
(`check_correction`, run by the processors' ``validate_params``: HTTP 400). A policy's head map
(`TemperaturePolicy.head_map`, only with a bias) is found the same way
(``head_map_file_name(sha256)``). ``noisy-temp-server
serve`` sets ``NTS_BIAS_DIR`` for its engine only when its policy can name a bias
(`server.engine.publish_bias_directories`: the profile's folder, then the folder the online
refinement publishes to).

`SlotBias` keeps the vectors on the device as the rows of one table ``[rows, V]``: row 0 stands
for "no bias", each correction a slot holds (a bias, with its head map if any: one per policy
version that has one) is loaded once, on the first admission that names it, into a row of its
own; a head map is loaded once for all the rows that name it. A slot releases its version when it
is given to a new occupant (V1 runner: also when its request leaves the batch; Model Runner V2
has no such hook, so a finished request's slot holds its version until vLLM reuses the slot);
the next admission wave drops the rows no slot holds, so the table follows the versions in use.
Each admission wave writes ``weight[slot, k]`` = 1 where the slot holds row ``k + 1``, else 0.
Per step, only while some slot holds a bias (a host-side count), the versions the batch's slots
hold are found on the host (V2: from vLLM's host-side slot list of the step, a ``bincount``;
none: nothing more happens), and each is added as ``weight[:, k] * table[k + 1]`` (one
broadcast ``addcmul_`` pass over the logits per version in the batch; no ``[R, V]`` gather,
which costs several passes on a CPU). Rows without a bias get ``x + 0 * b``: every value is
unchanged (±inf and NaN included) and bit for bit too, except that a ``-0.0`` logit may come
out as ``+0.0``, which no softmax, argmax or logprob can tell apart.

Before the biases, each head map a batch slot holds is applied (`_map_rows`) to every row of
the batch, ``z~ += L (R z~)`` as one ``[R, V] @ [V, r]`` and one ``addmm_`` (2 r V multiply-adds
per row), the coordinates ``R z~`` zeroed on the rows whose slot does not hold it, which get
``x + 0`` as above. The coordinates read the row with masked entries (−inf, from another
processor) raised to the row's lowest finite logit; a row whose coordinates are not finite
anyway (NaN or +inf logits, or every token masked) is left as it is, so a bad row reaches vLLM's
sampler as it would without the map (its bias is still added). The map reads the row as it
reaches the processor: a finite change δ made before it (a request's ``logit_bias``; under
Model Runner V2 also the penalties, which vLLM applies first) is served as δ + L R δ. One mapped
request costs the map's product for every row of its batch (the rows without it multiply too,
by zero).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from noisy_temp_server.correction.files import (
    check_bias_vocabulary,
    check_head_map_vocabulary,
    find_bias_file,
    find_head_map_file,
)
from noisy_temp_server.correction.head_map import HeadMap
from noisy_temp_server.engine_contract.engine_env import engine_config
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, KEY_BIAS, KEY_POLICY
from noisy_temp_server.engine_contract.request_args import (
    LogitCorrection,
    default_policy_json,
    parse_policy_json,
)

__all__ = [
    "FILE_CORRECTIONS",
    "CorrectionSource",
    "SlotBias",
    "bias_directories",
    "check_correction",
    "load_bias",
    "load_head_map",
]

_LOGGER = logging.getLogger(__name__)

_LOADED_BIASES = 8
_LOADED_MAPS = 2  # a map is 2 r V floats: 50 MB at rank 128 and a 49k vocabulary
_Loaded = TypeVar("_Loaded")


def bias_directories() -> tuple[Path, ...]:
    """Where the engine finds bias files, in order: the folders of ``NTS_BIAS_DIR``
    (`EngineConfig.bias_dirs`), else the folder of ``NTS_POLICY_FILE`` when that policy names
    a bias, else none (no bias possible). Raises ValueError when the policy file is needed and
    invalid."""
    config = engine_config()
    if config.bias_dirs:
        return config.bias_dirs
    if config.policy_file is not None and parse_policy_json(default_policy_json()).bias is not None:
        return (config.policy_file.parent,)
    return ()


@lru_cache(maxsize=_LOADED_BIASES)
def _load_bias(directories: tuple[Path, ...], sha256: str) -> torch.Tensor:
    return find_bias_file(directories, sha256)


@lru_cache(maxsize=_LOADED_MAPS)
def _load_head_map(directories: tuple[Path, ...], sha256: str) -> HeadMap:
    return find_head_map_file(directories, sha256)


def _from_bias_directories(
    what: str, sha256: str, load: Callable[[tuple[Path, ...], str], _Loaded]
) -> _Loaded:
    """`load` of the file of ``sha256`` from the bias directories; ValueError naming `what`
    (a 400 at admission) when there is no bias directory, no such file, or the file does not
    hold it."""
    directories = bias_directories()
    if not directories:
        raise ValueError(
            f"the policy ({KEY_POLICY}) names the {what} {sha256[:16]}..., but this engine has "
            f"no bias directory ({BIAS_DIR_ENV}); send {KEY_BIAS}=false or a policy without a "
            "bias."
        )
    try:
        return load(directories, sha256)
    except ValueError as error:
        raise ValueError(
            f"the {what} {sha256[:16]}... of the policy is not available to this engine: {error}"
        ) from None


def load_bias(sha256: str) -> torch.Tensor:
    """The bias vector (float32 [V] on the CPU) with content hash ``sha256`` from the first bias
    directory that has it; read once per (directories, hash) while recently used. ValueError
    as `_from_bias_directories`."""
    return _from_bias_directories("per-token bias", sha256, _load_bias)


def load_head_map(sha256: str) -> HeadMap:
    """The head map (float32, on the CPU) with content hash ``sha256``, found as `load_bias`
    finds a bias (the two most recent are kept)."""
    return _from_bias_directories("head map", sha256, _load_head_map)


@dataclass(frozen=True)
class CorrectionSource:
    """Where `SlotBias` gets the vectors a correction names: ``bias(sha256)``, a float32 [V]
    tensor on the CPU, and ``head_map(sha256)``, a `HeadMap`; each raises ValueError when it
    cannot. `FILE_CORRECTIONS` (the engine's): the bias directories."""

    bias: Callable[[str], torch.Tensor]
    head_map: Callable[[str], HeadMap]


FILE_CORRECTIONS = CorrectionSource(bias=load_bias, head_map=load_head_map)


def check_correction(correction: LogitCorrection | None) -> None:
    """ValueError unless the bias of ``correction`` (None: nothing to check) and its head map
    can be loaded (see `load_bias`)."""
    if correction is not None:
        load_bias(correction.bias)
        if correction.head_map is not None:
            load_head_map(correction.head_map)


class SlotBias:
    """The corrections (biases, and head maps under them) of ``slots`` slots over a vocabulary
    of ``vocab_size`` tokens on ``device`` (see the module docstring). ``vocab_size`` None: the
    engine's vocabulary is unknown, and every bias is refused at admission. ``source``: where
    the vectors come from (the bias directories unless told).

    `stage` / `flush` follow `SlotTuning`'s admission (host staging, one copy per wave); `add`
    is the per-step hook. ``biased_slots`` counts the slots holding a bias (host side).
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
        # k: row k + 1), the rows' vectors (every row but 0 has a user then), and each head map
        # held with the columns of the rows under it.
        self._flushed_row = self._host_row.copy()
        self.weight = torch.zeros(slots, 0, device=device)
        self._vectors: list[torch.Tensor] = []
        self._maps: dict[str, _DeviceMap] = {}
        self._map_uses: list[_MapUse] = []
        self._refused: set[LogitCorrection] = set()

    def stage(self, slot: int, correction: LogitCorrection | None) -> bool:
        """Give ``slot`` the bias (and head map) of ``correction`` (None: none) from the next
        `flush` on, releasing the version its previous occupant held; True when it has one. A
        vector or map whose vocabulary is not the engine's is refused (an error is logged once
        per hash and the slot gets neither: a bias means nothing without the map it was fitted
        on): `check_correction` in ``validate_params`` cannot see the engine's vocabulary."""
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
        last flush), else a new row at the end with the vector (and map) loaded (0 if
        refused)."""
        row = self._row_of.get(correction)
        if row is not None:
            return row
        try:  # gone since validate_params, or fitted for another model: serve without it
            vector = self.source.bias(correction.bias)
            check_bias_vocabulary(vector, self.vocab_size, "the engine")
            if correction.head_map is not None and correction.head_map not in self._maps:
                self._maps[correction.head_map] = self._device_map(correction.head_map)
        except ValueError as error:
            return self._refuse(correction, str(error))
        row = self._row_of[correction] = len(self._users)
        self._users.append(0)
        self.table = torch.cat((self.table, vector.to(self.device).unsqueeze(0)))
        return row

    def _device_map(self, sha256: str) -> _DeviceMap:
        head_map = self.source.head_map(sha256)
        check_head_map_vocabulary(head_map, self.vocab_size, "the engine")
        return _DeviceMap(
            right=head_map.right.to(self.device).contiguous(),
            left_t=head_map.left.to(self.device).T.contiguous(),
        )

    def _refuse(self, correction: LogitCorrection, why: str) -> int:
        if correction not in self._refused:
            self._refused.add(correction)
            _LOGGER.error("%s; requests naming it are served without a bias.", why)
        return 0

    @property
    def head_maps(self) -> frozenset[str]:
        """The sha256s of the head maps on the device (the rows of the table name them)."""
        return frozenset(self._maps)

    def flush(self) -> None:
        """After admissions changed the slots' rows: drop the rows no slot holds any more (the
        table shrinks to row 0 and the held versions, the maps to those the rows name) and
        write the slots' weights to the device (one copy)."""
        if not self._changed:
            return
        self._changed = False
        if not all(self._users[1:]):
            self._drop_free_rows()
        rows = np.arange(1, len(self._users), dtype=np.int64)
        self.weight = self._to_device(torch.from_numpy(self._host_row[:, None] == rows).float())
        self._vectors = list(self.table[1:])
        self._map_uses = self._uses_of_maps()
        self._flushed_row = self._host_row.copy()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return (host.pin_memory() if self._pin else host).to(self.device, non_blocking=True)

    def _uses_of_maps(self) -> list[_MapUse]:
        """Each head map the rows name, with the rows and the slots under it."""
        rows_of: dict[str, list[int]] = {}
        for correction, row in self._row_of.items():
            if correction.head_map is not None:
                rows_of.setdefault(correction.head_map, []).append(row)
        return [
            _MapUse(
                device_map=self._maps[sha],
                columns=frozenset(row - 1 for row in rows),
                slots=self._to_device(torch.from_numpy(np.isin(self._host_row, rows)[:, None])),
            )
            for sha, rows in rows_of.items()
        ]

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
        named = {correction.head_map for correction in self._row_of}
        self._maps = {sha: device_map for sha, device_map in self._maps.items() if sha in named}

    def add(
        self, logits: torch.Tensor, slots: torch.Tensor, batch_slots: np.ndarray | None = None
    ) -> None:
        """Apply each row's head map (if its slot's correction has one) and add its bias to
        ``logits`` ([R, V] float32, in place; ``slots``: [R] slot of each row): one pass over
        the logits per version held by a slot of the batch, and per head map a matrix product
        (`_map_rows`). Without ``batch_slots`` (the batch's slots on the host, any order and
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
        for use in self._map_uses:  # none while no slot holds a map: nothing per step
            if not use.columns.isdisjoint(columns):
                _map_rows(logits, use.slots.index_select(0, slots), use.device_map)
        weight = self.weight.index_select(0, slots)
        for column in columns:
            logits.addcmul_(weight[:, column : column + 1], self._vectors[column])

    def _held_columns(self, rows: np.ndarray) -> list[int]:
        """The weight columns of the versions among table ``rows`` (host work, no device sync)."""
        if len(self._vectors) == 1:  # the usual case: one version, nothing to count
            return [0] if rows.any() else []
        return np.flatnonzero(np.bincount(rows)[1:]).tolist()


@dataclass(frozen=True)
class _DeviceMap:
    """A head map on the engine's device: ``right`` R [r, V] and ``left_t`` Lᵀ [r, V], both
    contiguous, for ``z~ += (z~ Rᵀ) Lᵀ``."""

    right: torch.Tensor
    left_t: torch.Tensor


@dataclass(frozen=True)
class _MapUse:
    """A head map as of a flush: the weight ``columns`` of the rows under it, and ``slots``
    [slots, 1] (bool, on the device): the slots that hold one of those rows."""

    device_map: _DeviceMap
    columns: frozenset[int]
    slots: torch.Tensor


def _map_rows(logits: torch.Tensor, mapped: torch.Tensor, device_map: _DeviceMap) -> None:
    """``logits`` [R, V] += L (R z~) on the rows where ``mapped`` [R, 1] (bool) is true, in
    place; the coordinates read masked (−inf) entries as the row's lowest finite logit, and a
    row whose coordinates are not finite (NaN or +inf logits, every token masked) is left
    alone. Other rows get ``+ 0``. One [R, V] temporary; no boolean [R, V] mask."""
    guarded = logits.nan_to_num(nan=torch.nan, posinf=torch.inf, neginf=torch.inf)
    floor = guarded.amin(dim=1, keepdim=True)  # the lowest finite logit (NaN rows: NaN)
    torch.maximum(logits, floor, out=guarded)
    coordinates = guarded @ device_map.right.T
    mapped = mapped & coordinates.isfinite().all(dim=1, keepdim=True)
    logits.addmm_(torch.where(mapped, coordinates, 0.0), device_map.left_t)
