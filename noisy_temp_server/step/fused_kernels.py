"""The Triton kernels of the fused step (`fused_step.FusedStep` launches them; its docstring says
what a step computes): `_step_kernel`, one program per row and chunk of it, and `_moments_kernel`,
the softmax moments of the chunks of the rows whose rule reads them when rows are split.
Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

_STEP_MASK = tl.constexpr(0xFFFFFFFF)  # a step key's step (row kinds: 1 fisher, 2 calibrated)

__all__ = ["moments_kernel", "step_kernel"]


@triton.jit
def _cell_of(keys_ptr, row, edge_keys_ptr, n_edge_keys, search_steps):
    """(cell, step key) of the row: bucketize(key, edge_keys, right=True)."""
    key = tl.load(keys_ptr + row)
    low = n_edge_keys * 0
    high = n_edge_keys
    for _ in range(search_steps):
        middle = (low + high) // 2
        inside = middle < high
        edge = tl.load(edge_keys_ptr + middle, mask=inside, other=0)
        low = tl.where(inside & (edge <= key), middle + 1, low)
        high = tl.where(inside & (edge > key), middle, high)
    return low, key


@triton.jit
def _table_temperature(cell_table_ptr, cell, key, schedule):
    """The cell's value, through the schedule's factor and clamp while some slot holds one (a
    no-op for other rows: their beta is 0 and their T* within their bounds)."""
    temperature = tl.load(cell_table_ptr + cell * 4)
    if schedule != 0:
        beta = tl.load(cell_table_ptr + cell * 4 + 1)
        t_min = tl.load(cell_table_ptr + cell * 4 + 2)
        t_max = tl.load(cell_table_ptr + cell * 4 + 3)
        step = (key & _STEP_MASK).to(tl.float32)
        factor = tl.math.rsqrt(beta * step + 1.0)
        temperature = tl.minimum(tl.maximum(factor * temperature, t_min), t_max)
    return temperature


@triton.jit
def _merge(top_a, weight_a, mean_a, m2_a, top_b, weight_b, mean_b, m2_b):
    """Two parts' softmax moments as one: each part's (max, Σ exp(y - max), mean of y - max and
    Σ exp(y - max)·(y - max - mean)² under its weights), Chan's formula with the weights
    rescaled to the common max. A part without finite values has max -inf and weight 0."""
    top = tl.maximum(top_a, top_b)
    base = tl.where(top > float("-inf"), top, 0.0)
    scale_a = tl.exp(top_a - base)
    scale_b = tl.exp(top_b - base)
    weight_a = weight_a * scale_a
    weight_b = weight_b * scale_b
    weight = weight_a + weight_b
    centre_a = tl.where(weight_a > 0, mean_a + (top_a - base), 0.0)
    centre_b = tl.where(weight_b > 0, mean_b + (top_b - base), 0.0)
    safe = tl.where(weight > 0, weight, 1.0)
    delta = centre_b - centre_a
    mean = centre_a + delta * weight_b / safe
    m2 = m2_a * scale_a + m2_b * scale_b + delta * delta * weight_a * weight_b / safe
    return top, weight, mean, m2


@triton.jit
def _load_row(row_start, bias_start, bias_row, columns, valid, HAS_BIAS: tl.constexpr):
    """The row's values at ``columns`` plus its slot's bias (its ``bias_row``; 0: none)."""
    values = tl.load(row_start + columns, mask=valid, other=0.0)
    if HAS_BIAS:
        biased = (columns * 0 + bias_row) > 0
        bias = tl.load(bias_start + columns, mask=valid & biased, other=0.0)
        values = tl.where(biased, values + bias, values)
    return values


@triton.jit
def _seen(values, valid, nan_or_inf, live):
    """The block's running flags with ``values`` (where ``valid``) seen: a NaN or +inf, a live
    (not -inf) value."""
    nan_or_inf |= valid & ((values != values) | (values == float("inf")))  # noqa: PLR0124
    live |= valid & (values != float("-inf"))
    return nan_or_inf, live


@triton.jit
def _flags(nan_or_inf, live):
    """A row part's flags from the block's running ones: 1 NaN or +inf seen, 2 a live value."""
    return tl.max(nan_or_inf.to(tl.int32), 0) + 2 * tl.max(live.to(tl.int32), 0)


@triton.jit
def _moments(row_start, bias_start, bias_row, start, end, scale_up, scale_down, HAS_BIAS, BLOCK):
    """Softmax moments (`_merge`) of y = row·``scale_up``/``scale_down`` over columns
    [start, end), and the flags of the biased row there: 1 NaN or +inf seen, 2 a live value."""
    offsets = tl.arange(0, BLOCK)
    top = tl.full((), float("-inf"), tl.float32)
    weight = tl.zeros((), tl.float32)
    mean = tl.zeros((), tl.float32)
    m2 = tl.zeros((), tl.float32)
    nan_or_inf = tl.zeros([BLOCK], dtype=tl.int1)
    live = tl.zeros([BLOCK], dtype=tl.int1)
    for first in range(start, end, BLOCK):
        columns = first + offsets
        valid = columns < end
        values = _load_row(row_start, bias_start, bias_row, columns, valid, HAS_BIAS)
        nan_or_inf, live = _seen(values, valid, nan_or_inf, live)
        scaled = tl.math.div_rn(values * scale_up, scale_down)
        finite = valid & (scaled > float("-inf")) & (scaled < float("inf"))
        scaled = tl.where(finite, scaled, float("-inf"))
        block_top = tl.max(scaled, 0)
        shifted = tl.where(
            finite, scaled - tl.where(block_top > float("-inf"), block_top, 0.0), 0.0
        )
        weights = tl.where(finite, tl.exp(shifted), 0.0)
        block_weight = tl.sum(weights, 0)
        block_mean = tl.sum(weights * shifted, 0) / tl.where(block_weight > 0, block_weight, 1.0)
        centred = shifted - block_mean
        block_m2 = tl.sum(weights * centred * centred, 0)
        top, weight, mean, m2 = _merge(
            top, weight, mean, m2, block_top, block_weight, block_mean, block_m2
        )
    flags = _flags(nan_or_inf, live)
    return top, weight, mean, m2, flags


@triton.jit
def _gathered_moments(partials_ptr, chunks):
    """The moments and flags of a row from its chunks' (``partials_ptr``: the row's first)."""
    top = tl.full((), float("-inf"), tl.float32)
    weight = tl.zeros((), tl.float32)
    mean = tl.zeros((), tl.float32)
    m2 = tl.zeros((), tl.float32)
    flags = tl.zeros((), tl.int32)
    for chunk in range(chunks):
        part = partials_ptr + chunk * 5
        top, weight, mean, m2 = _merge(
            top,
            weight,
            mean,
            m2,
            tl.load(part),
            tl.load(part + 1),
            tl.load(part + 2),
            tl.load(part + 3),
        )
        flags |= tl.load(part + 4).to(tl.int32)
    return top, weight, mean, m2, flags


@triton.jit
def _feature_scales(kind, request_temperature, LOGITS_SCALED: tl.constexpr):
    """(up, down): the row the rule's statistics read is logits·up/down: ``fisher`` reads
    z̃/T_req, the calibrated table z̃ (the V1 runner's logits are already z̃/T_req)."""
    one = tl.full((), 1.0, tl.float32)
    up = one
    down = tl.where(kind == 1, request_temperature, one)
    if LOGITS_SCALED:
        up = tl.where(kind == 2, request_temperature, one)
        down = one
    return up, down


@triton.jit
def _read_temperature(kind, value, weight, mean, m2, flags, slot_reads, read_values_ptr, t_req):
    """T* (before the bounds) of a row whose rule reads it, from its moments: ``fisher``
    σ² / max(Var·T_req², floor) + 1, the calibrated table's entry at the entropy's bucket;
    NaN for a bad row (NaN or +inf in it, or all masked)."""
    parameter = tl.load(slot_reads + 1)
    if kind == 1:
        variance = m2 / weight * (t_req * t_req)
        temperature = tl.math.div_rn(value, tl.maximum(variance, parameter)) + 1.0
    else:
        offset = parameter.to(tl.int32)
        buckets = tl.load(slot_reads + 2).to(tl.int32)
        entropy = -tl.minimum(mean - tl.log(tl.where(weight > 0, weight, 1.0)), 0.0)
        bucket = buckets * 0
        for edge in range(1, buckets):
            bucket += (tl.load(read_values_ptr + offset + edge) <= entropy).to(tl.int32)
        row = offset + buckets + value.to(tl.int32) * buckets
        temperature = tl.load(read_values_ptr + row + bucket)
    bad = ((flags & 1) != 0) | ((flags & 2) == 0)
    return tl.where(bad, float("nan"), temperature)


@triton.jit
def _divide(row_start, bias_start, bias_row, start, end, temperature, HAS_BIAS, BLOCK):
    """Columns [start, end) of the biased row divided by T* (IEEE), in place; the flags of
    the biased values (`_moments`)."""
    offsets = tl.arange(0, BLOCK)
    nan_or_inf = tl.zeros([BLOCK], dtype=tl.int1)
    live = tl.zeros([BLOCK], dtype=tl.int1)
    for first in range(start, end, BLOCK):
        columns = first + offsets
        valid = columns < end
        values = _load_row(row_start, bias_start, bias_row, columns, valid, HAS_BIAS)
        nan_or_inf, live = _seen(values, valid, nan_or_inf, live)
        tl.store(row_start + columns, tl.math.div_rn(values, temperature), mask=valid)
    return _flags(nan_or_inf, live)


@triton.jit
def _account(
    row,
    slot,
    cell,
    temperature,
    flags,
    last,
    counted_ptr,
    has_counted,
    tuned_ptr,
    check_tuned,
    cell_table_ptr,
    varying,
    accumulators_ptr,
    extrema_ptr,
    n_cells,
    bad_rows_ptr,
):
    """The row's accounting, done by ``last`` (its last chunk): a bad row (``flags``) of a tuned
    slot adds 1 to the bad rows; the row's counted cell (cell 0 when not counted) adds 1 and T*
    (the cell's own T* unless T* ``varying``: then the row's, and its extrema)."""
    bad = ((flags & 1) != 0) | ((flags & 2) == 0)
    if check_tuned != 0:
        bad = bad & (tl.load(tuned_ptr + slot) != 0)
    one = tl.full((), 1.0, tl.float64)
    tl.atomic_add(bad_rows_ptr, tl.where(bad, one, 0.0), mask=last)
    counted_cell = cell
    if has_counted != 0:
        counted_cell = tl.where(tl.load(counted_ptr + row) != 0, cell, 0)
    value = temperature.to(tl.float64)
    if varying == 0:
        value = tl.load(cell_table_ptr + counted_cell * 4).to(tl.float64)
    tl.atomic_add(accumulators_ptr + counted_cell, one, mask=last)
    tl.atomic_add(accumulators_ptr + n_cells + counted_cell, value, mask=last)
    if varying != 0:
        tl.atomic_max(extrema_ptr + counted_cell, -value, mask=last)
        tl.atomic_max(extrema_ptr + n_cells + counted_cell, value, mask=last)


@triton.jit
def _trace(trace_ptr, row, slot, key, temperature, tracing, traced_ptr, first):
    """The row's T* into row 2 of the step's trace [4, R], and while ``tracing`` its slot, step
    and whether the slot is traced into rows 0, 1 and 3 (by the row's ``first`` chunk)."""
    rows = tl.num_programs(0)
    tl.store(trace_ptr + 2 * rows + row, temperature, mask=first)
    if tracing != 0:
        tl.store(trace_ptr + row, slot.to(tl.float32), mask=first)
        tl.store(trace_ptr + rows + row, (key & _STEP_MASK).to(tl.float32), mask=first)
        traced = tl.load(traced_ptr + slot).to(tl.float32)
        tl.store(trace_ptr + 3 * rows + row, traced, mask=first)


@triton.jit
def _last_arrival(flags_ptr, row, flags, chunks):
    """(whether this program is the row's last chunk to finish, the row's flags): each chunk
    ORs its flags into the row's and counts its arrival; the last one takes both, leaving
    zeros for the next step. One chunk: this one, with its own flags."""
    last = chunks == 1
    if chunks > 1:
        tl.atomic_or(flags_ptr + 2 * row, flags)
        arrived = tl.atomic_add(flags_ptr + 2 * row + 1, 1)
        last = arrived == chunks - 1
        gathered = tl.atomic_xchg(flags_ptr + 2 * row, 0, mask=last)
        tl.atomic_xchg(flags_ptr + 2 * row + 1, 0, mask=last)
        flags = tl.where(last, gathered, flags)
    return last, flags


_RUNTIME = ["has_counted", "check_tuned", "schedule", "reading", "tracing", "chunks"]
"""Flags and counts that change from step to step: not specialised on (an integer 1, or a
multiple of 16 such as 0, would compile a variant of its own)."""
_STEP_UNSPECIALISED = ["n_edge_keys", "search_steps", "n_cells", *_RUNTIME]
_STEP_UNALIGNED = [
    "slots_ptr", "keys_ptr", "counted_ptr", "tuned_ptr", "edge_keys_ptr", "cell_table_ptr",
    "bias_rows_ptr", "reads_ptr", "read_values_ptr", "request_temperature_ptr",
    "accumulators_ptr", "extrema_ptr", "bad_rows_ptr", "trace_ptr", "traced_ptr",
    "partials_ptr", "flags_ptr", *_STEP_UNSPECIALISED,
]  # fmt: skip
"""Not specialised on 16-byte alignment either: every pointer read or written an element at
a time. The logits' and the bias table's pointers, the row stride and the vocabulary are
(their loads are vectorised); `fused_step` keys its compiled variants on them."""


@triton.jit(do_not_specialize=_STEP_UNSPECIALISED, do_not_specialize_on_alignment=_STEP_UNALIGNED)
def step_kernel(
    logits_ptr, row_stride, vocab, slots_ptr, keys_ptr, counted_ptr, has_counted, tuned_ptr,
    check_tuned, edge_keys_ptr, n_edge_keys, search_steps, cell_table_ptr, schedule,
    bias_rows_ptr, bias_table_ptr, reading, reads_ptr, read_values_ptr, request_temperature_ptr,
    accumulators_ptr, extrema_ptr, n_cells, bad_rows_ptr, trace_ptr, tracing, traced_ptr,
    partials_ptr, flags_ptr, chunks, chunk_columns,
    HAS_BIAS: tl.constexpr, ACCOUNT: tl.constexpr, LOGITS_SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row and chunk of it (`FusedStep.__call__`).
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    cell, key = _cell_of(keys_ptr, row, edge_keys_ptr, n_edge_keys, search_steps)
    temperature = _table_temperature(cell_table_ptr, cell, key, schedule)
    row_start = logits_ptr + row.to(tl.int64) * row_stride
    bias_row = tl.zeros((), tl.int64)
    if HAS_BIAS:
        bias_row = tl.load(bias_rows_ptr + slot)
    bias_start = bias_table_ptr + bias_row * vocab  # row 0 of the table: no bias
    if reading != 0:
        kind = tl.load(reads_ptr + slot * 4).to(tl.int32)
        if kind != 0:
            t_req = tl.load(request_temperature_ptr + slot)
            if chunks == 1:
                up, down = _feature_scales(kind, t_req, LOGITS_SCALED)
                _top, weight, mean, m2, flags = _moments(
                    row_start, bias_start, bias_row, 0, vocab, up, down, HAS_BIAS, BLOCK
                )
            else:
                _top, weight, mean, m2, flags = _gathered_moments(
                    partials_ptr + row * chunks * 5, chunks
                )
            value = _read_temperature(
                kind, tl.load(cell_table_ptr + cell * 4), weight, mean, m2, flags,
                reads_ptr + slot * 4, read_values_ptr, t_req,
            )  # fmt: skip
            value = tl.where(value != value, 1.0, value)  # noqa: PLR0124 (NaN: T* = 1)
            t_min = tl.load(cell_table_ptr + cell * 4 + 2)
            t_max = tl.load(cell_table_ptr + cell * 4 + 3)
            temperature = tl.minimum(tl.maximum(value, t_min), t_max)
    _trace(trace_ptr, row, slot, key, temperature, tracing, traced_ptr, chunk == 0)
    start = chunk * chunk_columns
    end = tl.minimum(start + chunk_columns, vocab)
    flags = _divide(row_start, bias_start, bias_row, start, end, temperature, HAS_BIAS, BLOCK)
    if ACCOUNT:
        last, flags = _last_arrival(flags_ptr, row, flags, chunks)
        _account(
            row, slot, cell, temperature, flags, last, counted_ptr, has_counted, tuned_ptr,
            check_tuned, cell_table_ptr, schedule | reading, accumulators_ptr, extrema_ptr,
            n_cells, bad_rows_ptr,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=["chunks"],
    do_not_specialize_on_alignment=[
        "slots_ptr", "bias_rows_ptr", "reads_ptr", "request_temperature_ptr", "partials_ptr",
        "chunks",
    ],
)  # fmt: skip
def moments_kernel(
    logits_ptr, row_stride, vocab, slots_ptr, bias_rows_ptr, bias_table_ptr, reads_ptr,
    request_temperature_ptr, partials_ptr, chunks, chunk_columns,
    HAS_BIAS: tl.constexpr, LOGITS_SCALED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # The softmax moments of each chunk of the rows whose rule reads them, for `step_kernel`.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    kind = tl.load(reads_ptr + slot * 4).to(tl.int32)
    if kind != 0:
        bias_row = tl.zeros((), tl.int64)
        if HAS_BIAS:
            bias_row = tl.load(bias_rows_ptr + slot)
        t_req = tl.load(request_temperature_ptr + slot)
        up, down = _feature_scales(kind, t_req, LOGITS_SCALED)
        start = chunk * chunk_columns
        top, weight, mean, m2, flags = _moments(
            logits_ptr + row.to(tl.int64) * row_stride,
            bias_table_ptr + bias_row * vocab,
            bias_row,
            start,
            tl.minimum(start + chunk_columns, vocab),
            up,
            down,
            HAS_BIAS,
            BLOCK,
        )
        part = partials_ptr + (row * chunks + chunk) * 5
        tl.store(part, top)
        tl.store(part + 1, weight)
        tl.store(part + 2, mean)
        tl.store(part + 3, m2)
        tl.store(part + 4, flags.to(tl.float32))
