"""The engine's end of the trace channel: `TraceSender`, a PUSH socket connected to the API
process's collector (`server.trace_collector.TraceCollector`), which sends the messages of
`trace_wire`.

The processor builds it from the engine's configuration (`TraceSender.from_env`:
``NTS_TRACE_ENDPOINT``); without one (e.g. inside a stock vLLM server) there is no sender and
nothing is reported.

The sender never blocks the engine: it sends with ``NOBLOCK`` and a small high-water mark, and a
message that cannot be queued (peer absent or slow) is dropped and counted
(`TraceSender.dropped_messages`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
import zmq

from noisy_temp_server.engine_contract.engine_env import engine_config
from noisy_temp_server.engine_contract.trace_wire import (
    RowKey,
    StepRecord,
    SummaryRecord,
    encode_rows,
    encode_steps,
    encode_summaries,
)

__all__ = ["TraceSender"]

_LOGGER = logging.getLogger(__name__)
_SEND_HIGH_WATER_MARK = 1024


class TraceSender:
    """Engine side: a non-blocking PUSH socket connected to the collector's address.

    Not thread-safe (one sender per processor, used from the engine's step loop only).
    """

    def __init__(self, endpoint: str) -> None:
        """Connect to ``endpoint`` (a ZeroMQ address, e.g. ``ipc:///tmp/nts-trace.sock``).

        Connecting does not wait for the peer; messages sent before it is there are queued up to
        the high-water mark, then dropped.
        """
        self.endpoint = endpoint
        self.sender_id = uuid.uuid4().hex  # keys its cumulative drop counts on the collector
        self.dropped_messages = 0
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._warned_drop = False

    @classmethod
    def from_env(cls) -> TraceSender | None:
        """A sender for the engine's ``NTS_TRACE_ENDPOINT`` (`EngineConfig.trace_endpoint`), or
        None when it is unset or empty."""
        endpoint = engine_config().trace_endpoint
        return None if endpoint is None else cls(endpoint)

    def send_step(self, records: Sequence[StepRecord]) -> bool:
        """Send one step's ``(trace_id, step, T)`` records. Never blocks; False when dropped."""
        return self._send(encode_steps(records))

    def send_summaries(self, records: Sequence[SummaryRecord]) -> bool:
        """Send ``(trace_id, part, sum, count, min, max)`` cumulative summaries. Never blocks."""
        return self._send(encode_summaries(records))

    def send_rows(
        self,
        records: Sequence[RowKey],
        rows: np.ndarray,
        dropped: Sequence[RowKey] = (),
        drop_counts: Mapping[str, int] | None = None,
    ) -> bool:
        """Send captured ``(trace_id, step)`` rows (``rows`` float32 ``[len(records), V]``), the
        ``(trace_id, step)`` of dropped ones and this sender's cumulative drop counts by reason.
        Never blocks; False when dropped."""
        header, body = encode_rows(records, rows, dropped, drop_counts or {}, self.sender_id)
        return self._send(header, body)

    def _send(self, payload: bytes, body: np.ndarray | None = None) -> bool:
        """Queue one message; False (counted, the first one logged) when it cannot be queued."""
        try:
            if body is None:
                self._socket.send(payload, flags=zmq.NOBLOCK)
            else:
                self._socket.send_multipart([payload, body.data], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped_messages += 1
            if not self._warned_drop:
                self._warned_drop = True
                _LOGGER.warning(
                    "Temperature trace channel %s is full or has no reader; dropping trace "
                    "messages (counted in TraceSender.dropped_messages).",
                    self.endpoint,
                )
            return False
        return True

    def close(self) -> None:
        """Close the socket; pending messages are discarded (LINGER 0)."""
        self._socket.close(linger=0)
