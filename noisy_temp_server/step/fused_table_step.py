"""A step of the step-only table rules in one Triton kernel: what `slot_tuning.SlotTuning.tune`
does in about fifteen device operations for those rules (the bias, the cell's T*, the division,
the bad-row count and the accounting), in one launch that reads and writes each row once.

On CUDA the launches, not the bytes, are the cost of that torch path: each operation costs the
host some microseconds and the device waits for each launch, so the step's host time is added to
every decode step (docs/gpu.md has the figures). The torch path stays the reference and the
path everywhere else: on the CPU, for ``schedule`` and the rules that read the served row, for
the V1 runner's ``remember``, and for tensors this kernel does not take.
`tests/unit/test_fused_table_step.py` runs it against the torch path in Triton's interpreter,
and `benchmarks/gpu_check.py` on a GPU.

Importing this module imports Triton; `SlotTuning` imports it only when it uses the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_table_step"]

_BLOCK = 4096  # columns per iteration of a row's program, and its warps: the fastest measured
_WARPS = 16  # at batch 1, 64 and 256 (docs/gpu.md)


@triton.jit(do_not_specialize=["n_edge_keys", "search_steps", "n_cells"])  # they change at resize
def _table_step_kernel(
    logits_ptr,
    row_stride,
    vocab,
    slots_ptr,
    keys_ptr,
    counted_ptr,
    edge_keys_ptr,
    n_edge_keys,
    search_steps,
    cell_table_ptr,
    bias_rows_ptr,
    bias_table_ptr,
    tuned_ptr,
    accumulators_ptr,
    n_cells,
    bad_rows_ptr,
    temperature_ptr,
    HAS_BIAS: tl.constexpr,
    HAS_COUNTED: tl.constexpr,
    CHECK_TUNED: tl.constexpr,
    ACCOUNT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row.
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    key = tl.load(keys_ptr + row)
    # bucketize(key, edge_keys, right=True): how many edge keys are <= key.
    low = n_edge_keys * 0
    high = n_edge_keys
    for _ in range(search_steps):
        middle = (low + high) // 2
        inside = middle < high
        edge = tl.load(edge_keys_ptr + middle, mask=inside, other=0)
        low = tl.where(inside & (edge <= key), middle + 1, low)
        high = tl.where(inside & (edge > key), middle, high)
    cell = low
    temperature = tl.load(cell_table_ptr + cell * 4)
    tl.store(temperature_ptr + row, temperature)

    offsets = tl.arange(0, BLOCK)
    row_start = logits_ptr + row.to(tl.int64) * row_stride
    any_nan_or_inf = tl.zeros([BLOCK], dtype=tl.int1)
    any_live = tl.zeros([BLOCK], dtype=tl.int1)
    if HAS_BIAS:
        bias_row = tl.load(bias_rows_ptr + slot)
        bias_start = bias_table_ptr + bias_row * vocab
        biased = tl.zeros([BLOCK], tl.int64) + bias_row > 0  # row 0 of the table: no bias
    for start in range(0, vocab, BLOCK):
        columns = start + offsets
        valid = columns < vocab
        values = tl.load(row_start + columns, mask=valid, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_start + columns, mask=valid & biased, other=0.0)
            values = tl.where(biased, values + bias, values)
        is_nan = values != values  # noqa: PLR0124 (the NaN test)
        any_nan_or_inf |= valid & (is_nan | (values == float("inf")))
        any_live |= valid & (values != float("-inf"))
        tl.store(row_start + columns, tl.math.div_rn(values, temperature), mask=valid)

    if ACCOUNT:
        # The row's max before the division is NaN or infinite: NaN or +inf in it, or all -inf.
        nan_or_inf = tl.max(any_nan_or_inf.to(tl.int32), 0) > 0
        bad = nan_or_inf | (tl.max(any_live.to(tl.int32), 0) == 0)
        if CHECK_TUNED:
            bad = bad & (tl.load(tuned_ptr + slot) != 0)
        one = tl.full((), 1.0, tl.float64)
        tl.atomic_add(bad_rows_ptr, tl.where(bad, one, 0.0))
        counted_cell = cell
        if HAS_COUNTED:
            counted_cell = tl.where(tl.load(counted_ptr + row) != 0, cell, 0)
        counted_temperature = tl.load(cell_table_ptr + counted_cell * 4).to(tl.float64)
        tl.atomic_add(accumulators_ptr + counted_cell, one)
        tl.atomic_add(accumulators_ptr + n_cells + counted_cell, counted_temperature)


def _is_vector(tensor: torch.Tensor | None, length: int | None = None) -> bool:
    """None, or a 1-D contiguous tensor (of ``length`` entries, where given)."""
    if tensor is None:
        return True
    return tensor.dim() == 1 and tensor.is_contiguous() and length in (None, tensor.numel())


def _takes(
    logits: torch.Tensor,
    per_row: tuple[torch.Tensor | None, ...],
    tables: tuple[torch.Tensor | None, ...],
    cell_table: torch.Tensor,
    bias_table: torch.Tensor | None,
) -> bool:
    """Whether the kernel runs on these tensors (it indexes them so): float32 logits [R, V] of
    unit column stride, 1-D contiguous vectors (``per_row`` of R entries), a contiguous
    [cells, 4] cell table and, if biased, a contiguous bias table V wide."""
    return (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.stride(1) == 1
        and all(_is_vector(tensor, logits.shape[0]) for tensor in per_row)
        and all(_is_vector(tensor) for tensor in tables)
        and cell_table.is_contiguous()
        and cell_table.shape[1:] == (4,)
        and (
            bias_table is None
            or (bias_table.is_contiguous() and bias_table.shape[1:] == logits.shape[1:])
        )
    )


def fused_table_step(
    logits: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    *,
    edge_keys: torch.Tensor,
    cell_table: torch.Tensor,
    bias_rows: torch.Tensor | None,
    bias_table: torch.Tensor,
    temperature: torch.Tensor,
    accounts: tuple[torch.Tensor, torch.Tensor] | None,
    counted: torch.Tensor | None,
    tuned: torch.Tensor | None,
) -> bool:
    """One step of the step-only table rules, in place on ``logits`` [R, V], in one kernel
    launch, with no host sync. True when it ran; False, touching nothing, for tensors it does
    not take (`_takes`: then the torch path runs the step).

    Each row: its slot's bias (``bias_table[bias_rows[slot]]``, row 0 none; ``bias_rows`` None:
    no slot holds one), divided by its cell's T* (``cell_table[c, 0]`` of
    ``c = bucketize(key, edge_keys, right=True)``); ``temperature`` [R] float32 receives each
    row's T*. ``accounts``: (accumulators [2, cells], bad rows [1]) float64, or None for no
    accounting. With them, a counted row (``counted`` [R], None: all) adds (1, T*) to its
    cell's count and sum (a row not counted adds cell 0's to cell 0), and a bad row (NaN or
    +inf after the bias, or all -inf) of a tuned slot (``tuned`` [slots] bool, None: every
    row's slot is tuned) adds 1 to the bad rows: what the torch path of `SlotTuning.tune` does,
    up to the order of the floating-point sums, with the IEEE division."""
    per_row, tables = (slots, keys, counted, temperature), (edge_keys, tuned, bias_rows)
    if not _takes(
        logits, per_row, tables, cell_table, bias_table if bias_rows is not None else None
    ):
        return False
    rows, vocab = logits.shape
    if rows == 0:
        return True
    accumulators, bad_rows = accounts if accounts is not None else (temperature, temperature)
    _table_step_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        slots,
        keys,
        counted if counted is not None else slots,
        edge_keys,
        edge_keys.numel(),
        max(1, edge_keys.numel().bit_length()),
        cell_table,
        bias_rows if bias_rows is not None else slots,
        bias_table,
        tuned if tuned is not None else slots,
        accumulators,
        accumulators.shape[-1],
        bad_rows,
        temperature,
        HAS_BIAS=bias_rows is not None,
        HAS_COUNTED=counted is not None,
        CHECK_TUNED=tuned is not None,
        ACCOUNT=accounts is not None,
        BLOCK=_BLOCK,
        num_warps=_WARPS,
    )
    return True
