"""A step of every rule in Triton kernels: what `slot_tuning.SlotTuning.tune` does in fifteen to
a hundred device operations (the bias, each row's T*, the division, the bad-row count and the
accounting), in one launch that reads and writes each row once, or for the rules that read the
served row (``fisher``, a calibrated table over the entropy) reads it twice.

On CUDA the launches, not the bytes, are the cost of that torch path: each operation costs the
host some microseconds and the device waits for each launch, so the step's host time is added to
every decode step (docs/gpu.md has the figures). The torch path stays the reference and the
path everywhere else: on the CPU, for the V1 runner's ``remember``, and for tensors these
kernels do not take. `tests/unit/test_fused_step.py` runs them against the torch path in
Triton's interpreter, and `benchmarks/gpu_check.py` on a GPU.

Each row's T*: its cell (slot, step bucket: a binary search of the step key among the slots'
edge keys, as ``bucketize``) gives a row of the cell table (value, ``beta``, ``t_min``,
``t_max``); the value is T*, or the schedule's scale (times ``rsqrt(1 + beta * step)``, then
clamped, as `rules.schedule_temperature`), or for a slot whose rule reads the served row
(`row_reads.RowReads`: its kind and parameters per slot) ``fisher``'s σ² of the step bucket or
the row of the calibrated table for the request's band and step bucket. Those rows get the
softmax moments of their served row in a first pass over it (max, Σ exp, the weighted mean
and, merged block by block as Chan's parallel variance, the weighted variance), then T* from
them (a bad row, NaN or +inf or all masked, gets T* = 1), and the second pass divides.

Small batches: with fewer rows than `_PROGRAMS_PER_SM` programs per multiprocessor, each row is
split into chunks of whole blocks, one program each (`chunking`); the moments of a reading row
are then merged from each chunk's (one more launch), and the last chunk of a row to finish does
its accounting (an arrival count per row, left at zero for the next step). The kernels are
`fused_kernels`.

Importing this module imports Triton; `SlotTables` imports it only when it uses the kernels.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any

import torch
import triton

from noisy_temp_server.step.fused_kernels import moments_kernel, step_kernel

__all__ = ["FusedStep", "chunking"]

_LOGGER = logging.getLogger(__name__)

_BLOCK = 4096  # columns per iteration of a row's program, and its warps: the fastest measured
_WARPS = 16  # at batch 1, 64 and 256 (docs/gpu.md)
_PROGRAMS_PER_SM = 2  # below this many rows per multiprocessor, rows are split into chunks
_MOMENTS = 5  # a chunk's (max, Σ exp, mean, M2, flags) in the scratch of split rows


@functools.lru_cache(maxsize=512)
def chunking(rows: int, vocab: int, programs: int) -> tuple[int, int]:
    """(chunks per row, columns per chunk, a whole number of blocks): one chunk from
    ``programs`` rows on, else as many as make about ``programs`` programs (at most a block
    each)."""
    blocks = triton.cdiv(max(vocab, 1), _BLOCK)
    wanted = min(blocks, max(1, programs // max(rows, 1)))
    per_chunk = triton.cdiv(blocks, wanted)
    return triton.cdiv(blocks, per_chunk), per_chunk * _BLOCK


def _is_vector(tensor: torch.Tensor, length: int | None = None) -> bool:
    """A 1-D contiguous tensor (of ``length`` entries, where given)."""
    return tensor.dim() == 1 and tensor.is_contiguous() and length in (None, tensor.numel())


def _is_table(tensor: torch.Tensor, width: int) -> bool:
    return tensor.dim() == 2 and tensor.is_contiguous() and tensor.shape[1] == width


def _row_specialisation(logits: torch.Tensor, bias_table: torch.Tensor) -> tuple[bool, ...]:
    """What Triton specialises on in the arguments it is left to specialise (the logits' and
    the bias table's pointers, the row stride and the vocabulary; `fused_kernels`): 16-byte
    alignment, and for the integers whether they are 1."""
    stride, vocab = logits.stride(0), logits.shape[1]
    return (
        logits.data_ptr() % 16 == 0,
        bias_table.data_ptr() % 16 == 0,
        stride % 16 == 0,
        stride == 1,
        vocab % 16 == 0,
        vocab == 1,
    )


class _Launcher:
    """One kernel's launches: through Triton's launch the first time a specialisation key is
    seen (which compiles or finds the variant), then straight to that compiled kernel, without
    Triton's per-launch binding, specialisation and cache look-up. The caller's key must
    determine every specialisation (the constexprs, the tensors' dtypes and
    `_row_specialisation`). Where the direct launch is refused (a Triton whose launcher takes
    other arguments) or unavailable (the interpreter), Triton's launch is used."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self.direct = True

    @property
    def direct_variants(self) -> int:
        """How many compiled variants are launched directly."""
        return len(self._compiled)

    def __call__(
        self,
        key: tuple[Any, ...],
        grid: tuple[int, int],
        args: tuple[Any, ...],
        constants: dict[str, Any],
    ) -> None:
        compiled = self._compiled.get(key)
        if compiled is not None:
            try:
                compiled[(*grid, 1)](*args, *constants.values())
                return
            except TypeError:
                _LOGGER.warning("Triton refused the direct launch; launching through Triton")
                self.direct = False
                self._compiled.clear()
        found = self._kernel[grid](*args, **constants, num_warps=_WARPS)
        if self.direct and hasattr(found, "__getitem__"):
            self._compiled[key] = found


class FusedStep:
    """The fused step of one `SlotTuning` on ``device``: the launch of the kernels, their
    scratch (grown to the most rows seen) and their warm-up. ``programs``: split rows into
    chunks below this many rows (`chunking`; default `_PROGRAMS_PER_SM` per multiprocessor on
    CUDA, 0 elsewhere: whole rows)."""

    def __init__(self, device: torch.device, *, programs: int | None = None) -> None:
        self.device = device
        if programs is None:
            cuda = device.type == "cuda"
            sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
            programs = _PROGRAMS_PER_SM * sms
        self.programs = programs
        self._trace = torch.empty(0, dtype=torch.float32, device=device)
        self._flags = torch.zeros(0, dtype=torch.int32, device=device)
        self._partials = torch.empty(0, dtype=torch.float32, device=device)
        # Stands in for an absent per-slot flag table: a bool pointer, as the tables are, so
        # that the kernel has one variant whether they are given or not.
        self._no_flags = torch.zeros(1, dtype=torch.bool, device=device)
        self._checked_tables: tuple[int, ...] = ()
        self.step_launch = _Launcher(step_kernel)
        self.moments_launch = _Launcher(moments_kernel)

    def __call__(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        counted: torch.Tensor | None,
        *,
        tables: dict[str, torch.Tensor],
        bias_rows: torch.Tensor | None,
        tuned: torch.Tensor | None,
        accounts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        traced: torch.Tensor | None = None,
        schedule: bool,
        reading: bool,
        logits_scaled: bool,
    ) -> torch.Tensor | None:
        """One step in place on ``logits`` [R, V], with no host sync: each row's slot's bias
        (``bias_rows`` [slots] its row of ``tables["bias_table"]``, 0 none; None: no slot holds
        one), divided by its T*; returns the step's trace [4, R] float32 (a view of scratch,
        valid until the next call): row 2 each row's T*, and with ``traced`` ([slots] bool:
        which slots are traced) rows 0, 1, 3 each row's slot, step and whether its slot is
        traced, as `Reporter.stage_trace` takes them; or None, touching nothing, for tensors
        the kernels do not take.

        ``tables``: the `SlotTuning`'s ``edge_keys``, ``cell_table``, ``bias_table``,
        ``reads`` and ``read_values`` (`row_reads.RowReads`) and ``request_temperature``; they
        are checked when one of them is a new tensor. ``schedule``: some slot holds
        ``schedule``; ``reading``: some slot's rule reads the row. ``accounts``: (accumulators
        [2, cells], extrema [2, cells], bad rows [1]) float64, or None for no accounting; with
        them a counted row (``counted`` [R], None: all) adds 1 and T* to its cell's count and
        sum (and, with ``schedule`` or ``reading``, its T* to the extrema; a row not counted
        adds to cell 0), and a bad row (NaN or +inf after the bias, or all -inf) of a tuned
        slot (``tuned`` [slots] bool, None: every row's) adds 1 to the bad rows: what the torch
        path of `SlotTuning.tune` does, up to the order of the floating-point sums, with the
        IEEE division."""
        if not (
            self._takes(logits, (slots, keys, counted), (tuned, traced), bias_rows)
            and self._takes_tables(tables, logits.shape[1], bias_rows is not None)
        ):
            return None
        rows, vocab = logits.shape
        chunks, chunk_columns = chunking(rows, vocab, self.programs)
        self._fit(rows, chunks)
        trace = self._trace[: 4 * rows].view(4, rows)
        if rows == 0:
            return trace
        bias_table = tables["bias_table"]
        bias_rows_or_any = bias_rows if bias_rows is not None else slots
        has_bias = bias_rows is not None
        specialisation = _row_specialisation(logits, bias_table)
        if reading and chunks > 1:
            self.moments_launch(
                (has_bias, logits_scaled, slots.dtype, bias_rows_or_any.dtype, *specialisation),
                (rows, chunks),
                (
                    logits, logits.stride(0), vocab, slots, bias_rows_or_any, bias_table,
                    tables["reads"], tables["request_temperature"], self._partials, chunks,
                    chunk_columns,
                ),
                {"HAS_BIAS": has_bias, "LOGITS_SCALED": logits_scaled, "BLOCK": _BLOCK},
            )  # fmt: skip
        self._launch_step(
            logits, slots, keys, counted, tables=tables, bias_rows_or_any=bias_rows_or_any,
            has_bias=has_bias, tuned=tuned, accounts=accounts, traced=traced, trace=trace,
            schedule=schedule, reading=reading, logits_scaled=logits_scaled,
            chunks=(chunks, chunk_columns), specialisation=specialisation,
        )  # fmt: skip
        return trace

    def _launch_step(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        counted: torch.Tensor | None,
        *,
        tables: dict[str, torch.Tensor],
        bias_rows_or_any: torch.Tensor,
        has_bias: bool,
        tuned: torch.Tensor | None,
        accounts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        traced: torch.Tensor | None,
        trace: torch.Tensor,
        schedule: bool,
        reading: bool,
        logits_scaled: bool,
        chunks: tuple[int, int],
        specialisation: tuple[bool, ...],
    ) -> None:
        """`step_kernel` on the tensors `__call__` took (its arguments there; the bias rows, or
        the slots standing in for them, with whether some slot holds a bias)."""
        accumulators, extrema, bad_rows = accounts or (trace, trace, trace)
        counted_or_any = counted if counted is not None else slots
        tuned_or_none = tuned if tuned is not None else self._no_flags
        traced_or_none = traced if traced is not None else self._no_flags
        edge_keys = tables["edge_keys"]
        constants = {
            "HAS_BIAS": has_bias, "ACCOUNT": accounts is not None,
            "LOGITS_SCALED": logits_scaled, "BLOCK": _BLOCK,
        }  # fmt: skip
        key = (
            *constants.values(), slots.dtype, keys.dtype, counted_or_any.dtype,
            tuned_or_none.dtype, traced_or_none.dtype, bias_rows_or_any.dtype, *specialisation,
        )  # fmt: skip
        self.step_launch(
            key,
            (logits.shape[0], chunks[0]),
            (
                logits, logits.stride(0), logits.shape[1], slots, keys, counted_or_any,
                int(counted is not None), tuned_or_none, int(tuned is not None),
                edge_keys, edge_keys.numel(), max(1, edge_keys.numel().bit_length()),
                tables["cell_table"], int(schedule), bias_rows_or_any, tables["bias_table"],
                int(reading), tables["reads"], tables["read_values"],
                tables["request_temperature"], accumulators, extrema, accumulators.shape[-1],
                bad_rows, trace, int(traced is not None), traced_or_none, self._partials,
                self._flags, *chunks,
            ),
            constants,
        )  # fmt: skip

    def warm_up(
        self, vocab: int, *, counted: torch.dtype | None, accounting: bool, logits_scaled: bool
    ) -> None:
        """Compile the variants a processor runs (its ``vocab``, int64 slots and keys, its
        ``counted`` dtype or None, whether it accounts and whether its logits are scaled), with
        and without a bias, chunked and not: each kernel runs once on a dummy row of its own
        (nothing of the processor's is touched)."""
        device = self.device
        tables = {
            "edge_keys": torch.zeros(1, dtype=torch.int64, device=device),
            "cell_table": torch.tensor([[1.0, 0.0, 1.0, 1.0]] * 2, device=device),  # cell 1
            "bias_table": torch.zeros(2, vocab, device=device),
            "reads": torch.zeros(1, 4, device=device),
            "read_values": torch.zeros(1, device=device),
            "request_temperature": torch.ones(1, device=device),
        }
        slots = torch.zeros(1, dtype=torch.int64, device=device)
        rows = None if counted is None else torch.ones(1, dtype=counted, device=device)
        state = torch.zeros(9, dtype=torch.float64, device=device)
        accounts = (state[:4].view(2, 2), state[4:8].view(2, 2), state[8:]) if accounting else None
        programs = self.programs
        try:
            for self.programs, bias_rows in itertools.product((1, 2), (None, slots)):
                self(
                    torch.zeros(1, vocab, device=device), slots, slots, rows, tables=tables,
                    bias_rows=bias_rows, tuned=None, accounts=accounts, traced=slots == 0,
                    schedule=True, reading=True, logits_scaled=logits_scaled,
                )  # fmt: skip
        finally:
            self.programs = programs

    def _fit(self, rows: int, chunks: int) -> None:
        """Scratch for ``rows`` rows of ``chunks`` chunks (the flags start at zero and the
        kernels leave them so)."""
        if self._trace.numel() < 4 * rows:
            self._trace = torch.empty(4 * rows, dtype=torch.float32, device=self.device)
            self._flags = torch.zeros(2 * rows, dtype=torch.int32, device=self.device)
        if chunks > 1 and self._partials.numel() < rows * chunks * _MOMENTS:
            self._partials = torch.empty(
                rows * chunks * _MOMENTS, dtype=torch.float32, device=self.device
            )

    @staticmethod
    def _takes(
        logits: torch.Tensor,
        per_row: tuple[torch.Tensor | None, ...],
        per_slot: tuple[torch.Tensor | None, ...],
        bias_rows: torch.Tensor | None,
    ) -> bool:
        """Whether the kernels run on this step's tensors (they index them so): float32 logits
        [R, V] of unit column stride and 1-D contiguous vectors (``per_row`` of R entries)."""
        return (
            logits.dim() == 2
            and logits.dtype == torch.float32
            and logits.stride(1) == 1
            and all(tensor is None or _is_vector(tensor, logits.shape[0]) for tensor in per_row)
            and all(flags is None or _is_vector(flags) for flags in per_slot)
            and (bias_rows is None or _is_vector(bias_rows))
        )

    def _takes_tables(self, tables: dict[str, torch.Tensor], vocab: int, biased: bool) -> bool:
        """Whether the kernels take ``tables`` (checked again only when one is a new tensor):
        1-D contiguous vectors, contiguous [cells, 4] cell and [slots, 4] reads tables and, if
        some slot is ``biased``, a contiguous bias table ``vocab`` wide."""
        bias_table = tables["bias_table"]
        if biased and not _is_table(bias_table, vocab):
            return False
        identity = tuple(id(table) for table in tables.values())
        if identity == self._checked_tables:
            return True
        taken = (
            all(_is_vector(tables[name]) for name in ("edge_keys", "read_values"))
            and _is_vector(tables["request_temperature"])
            and _is_table(tables["cell_table"], 4)
            and _is_table(tables["reads"], 4)
        )
        self._checked_tables = identity if taken else ()
        return taken
