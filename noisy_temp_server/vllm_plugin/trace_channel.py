"""The per-step temperature trace, from vLLM's engine process to the API process.

The logits processor runs inside vLLM's engine (or worker) process, the HTTP response is built
in the API process. Between them runs one ZeroMQ PUSH → PULL channel:

- the API process owns a `TraceCollector`, which *binds* a PULL socket on an address (an
  ``ipc://`` path in production, any ZeroMQ address in tests) and puts that address into the
  environment as ``NTS_TRACE_ENDPOINT`` *before* it starts the engine;
- the processor builds a `TraceSender` from the environment (`TraceSender.from_env`), which
  *connects* a PUSH socket there. Without ``NTS_TRACE_ENDPOINT`` (e.g. inside a stock vLLM
  server) there is no sender and nothing is reported.

Wire format: one message per engine step, the UTF-8 JSON array ``[[trace_id, step, T], ...]`` of
that step's traced rows (``step`` = the row's generation step, 0 for the first generated token;
``T`` = the T* applied, not including the request's own temperature).

The sender never blocks the engine: it sends with ``NOBLOCK`` and a small high-water mark, and a
message that cannot be queued (peer absent or slow) is dropped and counted
(`TraceSender.dropped_messages`). The collector keeps memory bounded: an id is forgotten once
`TraceCollector.wait_for` has returned it, and ids nobody waits for expire after a TTL.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

__all__ = [
    "TRACE_ENDPOINT_ENV",
    "TraceCollector",
    "TraceSender",
]

TRACE_ENDPOINT_ENV = "NTS_TRACE_ENDPOINT"

_LOGGER = logging.getLogger(__name__)
_SEND_HIGH_WATER_MARK = 1024
_RECEIVE_POLL_MS = 100
_EXPIRY_INTERVAL_S = 1.0


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
        self.dropped_messages = 0
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._warned_drop = False

    @classmethod
    def from_env(cls) -> TraceSender | None:
        """A sender for ``$NTS_TRACE_ENDPOINT``, or None when it is unset or empty."""
        endpoint = os.environ.get(TRACE_ENDPOINT_ENV, "").strip()
        return cls(endpoint) if endpoint else None

    def send_step(
        self, trace_ids: Sequence[str], steps: Sequence[int], temperatures: Sequence[float]
    ) -> bool:
        """Send one step's records (three equal-length sequences). Never blocks.

        Returns False (and counts the drop, logging the first one) when the message could not be
        queued.
        """
        payload = json.dumps(
            [
                [tid, int(s), float(t)]
                for tid, s, t in zip(trace_ids, steps, temperatures, strict=True)
            ],
            separators=(",", ":"),
        ).encode()
        try:
            self._socket.send(payload, flags=zmq.NOBLOCK)
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


@dataclass
class _PendingTrace:
    temperatures_by_step: dict[int, float] = field(default_factory=dict)
    last_update: float = field(default_factory=time.monotonic)


class TraceCollector:
    """API side: binds a PULL socket and gathers per-step temperatures by trace id.

    A background daemon thread reads the socket. Use as a context manager, or call `start` and
    `close`. Thread-safe: `wait_for` may be called from any thread (from asyncio, run it in an
    executor, e.g. ``await asyncio.to_thread(collector.wait_for, ...)``).
    """

    def __init__(self, endpoint: str, *, ttl_s: float = 600.0, max_ids: int = 100_000) -> None:
        """``endpoint``: the address to bind (``ipc://...``; ``tcp://127.0.0.1:*`` picks a free
        port, see `endpoint` after `start`). ``ttl_s``: an id that has not received a record for
        this long is forgotten. ``max_ids``: beyond this many pending ids the oldest are
        forgotten first.
        """
        if ttl_s <= 0 or max_ids <= 0:
            raise ValueError("TraceCollector needs ttl_s > 0 and max_ids > 0.")
        self._requested_endpoint = endpoint
        self.endpoint = endpoint
        self._ttl_s = ttl_s
        self._max_ids = max_ids
        self._pending: dict[str, _PendingTrace] = {}
        self._condition = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self.malformed_messages = 0

    def start(self) -> TraceCollector:
        """Bind the socket and start the reader thread. Returns self."""
        if self._thread is not None:
            raise RuntimeError("TraceCollector already started.")
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self._requested_endpoint)
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = socket
        self._thread = threading.Thread(
            target=self._read_loop, name="nts-trace-collector", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the reader thread and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._condition:
            self._condition.notify_all()

    def __enter__(self) -> TraceCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_for(self, trace_id: str, n_steps: int, timeout: float) -> list[float]:
        """The temperatures of steps ``0..n_steps-1`` of ``trace_id``, in step order.

        Waits up to ``timeout`` seconds for all of them; on timeout returns the ones that arrived
        (in step order, possibly fewer than ``n_steps``; empty when none did). The id is
        forgotten afterwards either way.
        """
        deadline = time.monotonic() + timeout
        with self._condition:
            while True:
                pending = self._pending.get(trace_id)
                have = 0 if pending is None else len(pending.temperatures_by_step)
                remaining = deadline - time.monotonic()
                if have >= n_steps or remaining <= 0 or self._stop.is_set():
                    break
                self._condition.wait(remaining)
            pending = self._pending.pop(trace_id, None)
        if pending is None:
            return []
        by_step = pending.temperatures_by_step
        return [by_step[s] for s in sorted(by_step) if s < n_steps]

    def pending_ids(self) -> int:
        """How many trace ids are held (for tests and diagnostics)."""
        with self._condition:
            return len(self._pending)

    def _read_loop(self) -> None:
        assert self._socket is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_expiry = time.monotonic() + _EXPIRY_INTERVAL_S
        try:
            while not self._stop.is_set():
                if poller.poll(_RECEIVE_POLL_MS):
                    while True:
                        try:
                            message = self._socket.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._ingest(message)
                now = time.monotonic()
                if now >= next_expiry:
                    self._expire(now)
                    next_expiry = now + _EXPIRY_INTERVAL_S
        finally:
            self._socket.close(linger=0)

    def _ingest(self, message: bytes) -> None:
        try:
            records = [(str(tid), int(step), float(t)) for tid, step, t in json.loads(message)]
        except (ValueError, TypeError):
            self.malformed_messages += 1
            return
        now = time.monotonic()
        with self._condition:
            for trace_id, step, temperature in records:
                pending = self._pending.get(trace_id)
                if pending is None:
                    pending = self._pending[trace_id] = _PendingTrace()
                pending.temperatures_by_step[step] = temperature
                pending.last_update = now
            self._condition.notify_all()

    def _expire(self, now: float) -> None:
        with self._condition:
            stale = [tid for tid, p in self._pending.items() if now - p.last_update > self._ttl_s]
            for trace_id in stale:
                del self._pending[trace_id]
            excess = len(self._pending) - self._max_ids
            if excess > 0:
                oldest = sorted(self._pending, key=lambda tid: self._pending[tid].last_update)
                for trace_id in oldest[:excess]:
                    del self._pending[trace_id]
