"""The host memory the reporter copies into, allocated once (`step.host_copies`), and the fused
step's direct launches (`step.fused_step._Launcher`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from noisy_temp_server.step.host_copies import PinnedRows, PinnedTraces


def _starts(rows: PinnedRows, *counts: int) -> list[int | None]:
    """The first row of each block taken (None: refused)."""
    row_bytes = rows.buffer.stride(0) * rows.buffer.element_size()
    base = rows.buffer.data_ptr()
    blocks = [rows.take(count) for count in counts]
    return [None if block is None else (block.data_ptr() - base) // row_bytes for block in blocks]


def test_pinned_rows_hand_out_blocks_first_in_first_out() -> None:
    rows = PinnedRows(8, 3, pin=False)
    assert _starts(rows, 3, 3) == [0, 3]
    assert rows.take(3) is None  # 2 rows left after the newest block, and row 0 is taken
    rows.release()  # frees rows 0-2
    assert _starts(rows, 3) == [0]  # wraps to row 0
    assert rows.take(1) is None  # between the newest block (0-2) and the oldest (3-5): none
    rows.release()
    rows.release()
    assert _starts(rows, 8) == [0]
    assert rows.take(1) is None


def test_pinned_rows_wrap_and_fill_the_gap_before_the_oldest_block() -> None:
    rows = PinnedRows(10, 2, pin=False)
    assert _starts(rows, 4, 4) == [0, 4]
    rows.release()  # rows 0-3 free, 4-7 taken
    assert _starts(rows, 2, 2) == [8, 0]  # after the newest, then wrapped
    assert _starts(rows, 2) == [2]  # the gap up to the oldest block (4)
    assert rows.take(1) is None
    assert rows.take(11) is None


def test_pinned_rows_refuse_a_block_larger_than_the_buffer() -> None:
    assert PinnedRows(4, 2, pin=False).take(5) is None


def test_pinned_traces_keep_order_and_drop_when_every_slot_waits() -> None:
    traces = PinnedTraces(2, 3, torch.device("cpu"))
    first = torch.arange(12, dtype=torch.float32).view(4, 3)
    second = -torch.arange(8, dtype=torch.float32).view(4, 2)
    assert traces.stage(first, "a")
    assert traces.stage(second, "b")
    assert not traces.stage(first, "c")  # both slots wait for the reader
    waiting = traces.waiting()
    assert [(rows, occupancy) for _, rows, occupancy in waiting] == [(3, "a"), (2, "b")]
    assert (traces.read(waiting[0][0], 3) == first.numpy()).all()
    assert (traces.read(waiting[1][0], 2) == second.numpy()).all()
    first.zero_()  # the slots hold copies
    assert traces.read(waiting[0][0], 3).sum() == 66
    traces.release(1)
    assert traces.stage(first, "c")
    assert [occupancy for _, _, occupancy in traces.waiting()] == ["b", "c"]


def test_pinned_traces_grow_for_a_wider_batch_only_when_none_waits() -> None:
    traces = PinnedTraces(2, 1, torch.device("cpu"))
    wide = torch.ones(4, 5)
    assert traces.stage(wide, "a")  # nothing waits: the slots grow
    assert traces.stage(torch.ones(4, 1), "b")
    assert not traces.stage(torch.ones(4, 9), "c")
    traces.release(2)
    assert traces.stage(torch.ones(4, 9), "c")
    ((slot, rows, _),) = traces.waiting()
    assert traces.read(slot, rows).shape == (4, 9)


class _Compiled:
    def __init__(self, log: list[Any], *, refuse: bool = False) -> None:
        self.log, self.refuse = log, refuse

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any) -> None:
            if self.refuse:
                raise TypeError("takes other arguments")
            self.log.append(("direct", grid, args))

        return launch


class _Kernel:
    """Stands in for a Triton JIT function: its launch returns a compiled kernel."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.log: list[Any] = []
        self.refuse = refuse

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> _Compiled:
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log, refuse=self.refuse)

        return launch


def test_the_launcher_goes_direct_once_triton_found_the_variant_of_a_key() -> None:
    from noisy_temp_server.step.fused_step import _Launcher  # noqa: PLC0415 (imports Triton)

    kernel = _Kernel()
    launch = _Launcher(kernel)
    launch(("a",), (2, 1), (1, 2), {"BLOCK": 8})
    launch(("a",), (3, 1), (4, 5), {"BLOCK": 8})
    launch(("b",), (3, 1), (4, 5), {"BLOCK": 8})
    kinds = [entry[0] for entry in kernel.log]
    assert kinds == ["triton", "direct", "triton"]
    assert kernel.log[1][1:] == ((3, 1, 1), (4, 5, 8))  # every argument, constexprs last
    assert kernel.log[0][3]["BLOCK"] == 8


def test_the_launcher_falls_back_to_triton_when_the_direct_launch_is_refused() -> None:
    from noisy_temp_server.step.fused_step import _Launcher  # noqa: PLC0415 (imports Triton)

    kernel = _Kernel(refuse=True)
    launch = _Launcher(kernel)
    for _ in range(3):
        launch(("a",), (1, 1), (), {})
    assert [entry[0] for entry in kernel.log] == ["triton"] * 3
    assert not launch.direct


@pytest.mark.parametrize("found", [None, 3])
def test_the_launcher_keeps_launching_through_triton_without_a_compiled_kernel(
    found: Any,
) -> None:
    from noisy_temp_server.step.fused_step import _Launcher  # noqa: PLC0415 (imports Triton)

    calls: list[int] = []

    class Interpreted:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **kwargs: calls.append(1) or found

    launch = _Launcher(Interpreted())
    for _ in range(3):
        launch(("a",), (1, 1), (), {})
    assert len(calls) == 3


def test_the_reporter_drops_traces_past_its_slots_counts_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from noisy_temp_server.step.engine_metrics import step_temperature_metrics  # noqa: PLC0415
    from noisy_temp_server.step.reports import _TRACE_DEPTH, Reporter  # noqa: PLC0415

    reporter = Reporter(None, step_temperature_metrics(CollectorRegistry()), slots=2)
    reporter._start = lambda: None  # type: ignore[method-assign]  (no reader: the slots fill)
    for _ in range(_TRACE_DEPTH + 3):
        reporter.stage_trace(torch.zeros(4, 2))
    assert reporter.trace_dropped_steps == 3
    warnings = [record for record in caplog.records if "dropping per-step traces" in record.message]
    assert len(warnings) == 1
    reporter.flush()  # the reader frees every slot
    reporter.stage_trace(torch.zeros(4, 2))
    assert reporter.trace_dropped_steps == 3
