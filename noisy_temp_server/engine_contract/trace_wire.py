"""The messages of the trace channel: what the engine's `trace_sender.TraceSender` sends and the
API process's `server.trace_collector.TraceCollector` reads, encoded and decoded here only.

UTF-8 JSON objects of two kinds (``T`` = the T* applied, without the request's own
temperature):

- ``{"t": [[trace_id, step, T], ...]}``: one engine step's rows of traced requests (``nts_trace``
  or the server's shadow sample); ``step`` = the generation step, 0 for the first token;
- ``{"s": [[trace_id, part, sum, count, min, max], ...]}``: cumulative T* summaries of requests
  (every tuned request with a trace id), one per *part* (an occupancy of an engine slot; a
  preempted request has several). A later summary of the same part replaces the earlier one.

and one two-part kind, the served-logit rows of shadow-sampled requests (`vllm_plugin.capture`):

- ``{"c": [[trace_id, step], ...], "d": [[trace_id, step], ...], "v": V, "n": {reason: count},
  "e": sender}`` then the rows as raw float32 ``[len(c), V]`` (native byte order: both ends run
  on the same host); ``d`` lists the steps whose rows the engine dropped (bounds, full queue),
  so nobody waits for them; ``n`` is the sending engine's cumulative count of dropped rows by
  reason (`DROP_REASONS`) and ``e`` names that sender (`TraceSender.sender_id`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DROP_REASONS",
    "RowKey",
    "RowsMessage",
    "StepRecord",
    "SummaryRecord",
    "TraceMessage",
    "decode_rows",
    "decode_trace",
    "encode_rows",
    "encode_steps",
    "encode_summaries",
]

DROP_REASONS = ("rows_per_step", "speculative", "queue_full", "buffer_full")
"""Why a captured row was dropped (`capture`): over ``rows_per_step`` in its step; several rows
per request (Model Runner V2's speculative decoding); the engine reporter's queue full
(``queue_rows``); evicted from the API process's buffer (``max_row_bytes``) before the scorer
took it."""

StepRecord = tuple[str, int, float]
"""``(trace_id, step, T)``: the T* of one generation step of a request."""
SummaryRecord = tuple[str, int, float, int, float, float]
"""``(trace_id, part, sum, count, min, max)``: the cumulative T* summary of one part."""
RowKey = tuple[str, int]
"""``(trace_id, step)``: which request and generation step a captured row belongs to."""


@dataclass(frozen=True)
class TraceMessage:
    """A decoded one-part message: its per-step T* records and its summaries (either may be
    empty)."""

    steps: list[StepRecord]
    summaries: list[SummaryRecord]


@dataclass(frozen=True)
class RowsMessage:
    """A decoded rows message: ``rows`` float32 ``[len(captured), V]`` (the row of
    ``captured[i]`` at ``i``), the keys of the rows dropped, and the cumulative drop counts of
    the engine ``sender``."""

    captured: list[RowKey]
    dropped: list[RowKey]
    drop_counts: dict[str, int]
    sender: str
    rows: np.ndarray


def encode_steps(records: Sequence[StepRecord]) -> bytes:
    """One step's ``(trace_id, step, T)`` records."""
    return _json({"t": [[tid, int(step), float(t)] for tid, step, t in records]})


def encode_summaries(records: Sequence[SummaryRecord]) -> bytes:
    """``(trace_id, part, sum, count, min, max)`` cumulative summaries."""
    return _json({"s": [list(record) for record in records]})


def encode_rows(
    records: Sequence[RowKey],
    rows: np.ndarray,
    dropped: Sequence[RowKey],
    drop_counts: Mapping[str, int],
    sender: str,
) -> tuple[bytes, np.ndarray]:
    """The two parts of a rows message: the JSON header and the rows (``rows`` float32
    ``[len(records), V]``, made contiguous float32)."""
    header: dict[str, object] = {"c": [list(r) for r in records]}
    header |= {"d": [list(d) for d in dropped], "v": int(rows.shape[-1])}
    header |= {"n": dict(drop_counts), "e": sender}
    return _json(header), np.ascontiguousarray(rows, dtype=np.float32)


def decode_trace(message: bytes) -> TraceMessage:
    """A one-part message. Raises ValueError when it is not one."""
    try:
        data = json.loads(message)
        steps = [(str(tid), int(step), float(t)) for tid, step, t in data.get("t", ())]
        summaries = [
            (str(tid), int(part), float(total), int(count), float(low), float(high))
            for tid, part, total, count, low, high in data.get("s", ())
        ]
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"malformed trace message: {error}") from None
    return TraceMessage(steps, summaries)


def decode_rows(parts: Sequence[bytes]) -> RowsMessage:
    """A two-part rows message. Raises ValueError when it is not one."""
    try:
        header = json.loads(parts[0])
        captured = [(str(tid), int(step)) for tid, step in header["c"]]
        dropped = [(str(tid), int(step)) for tid, step in header["d"]]
        counts = {str(reason): int(n) for reason, n in header.get("n", {}).items()}
        sender = str(header.get("e", ""))
        width = int(header["v"]) if captured else 0
        rows = np.frombuffer(parts[1], dtype=np.float32).reshape(len(captured), width)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as error:
        raise ValueError(f"malformed rows message: {error}") from None
    return RowsMessage(captured, dropped, counts, sender, rows)


def _json(message: dict[str, object]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()
