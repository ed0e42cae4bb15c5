"""The API process's end of the trace channel, from vLLM's engine process: `TraceCollector`.

The logits processor runs in vLLM's engine process, the HTTP response is built in the API
process. Between them runs one ZeroMQ PUSH → PULL channel: the collector *binds* a PULL socket
(an ``ipc://`` path in production, any ZeroMQ address in tests), whose address the server hands
to the engine as ``NTS_TRACE_ENDPOINT`` (`engine_contract.engine_env.EngineConfig`) before it
starts it; the processor's `engine_contract.trace_sender.TraceSender` *connects* there and
sends the messages of `engine_contract.trace_wire`.

`engine_contract.trace_channel.TraceSource` is what the API process's readers need of the
collector (they are handed it, so the `online` package never imports this one): the HTTP layer
waits for a choice's T* (`wait_for`, a coroutine: the reader thread resolves asyncio futures, so
a waiting request ties up no thread); the shadow scorer takes captured rows (`take_rows`), held
apart from the T* reports because it may come long after the response, and the drop counts
summed over the senders (`capture_drops`; data-parallel engines each report their own, a
restarted engine is a new sender).

Memory stays bounded: an id is forgotten once `wait_for` has returned it or the server calls
`forget`, and records arriving for it during a grace period afterwards (the engine's last
reports lag the response) are dropped; ids nobody waits for expire after a TTL. Captured rows
are held up to ``max_row_bytes`` in all (the oldest request's go first) and for ``rows_ttl_s``;
rows arriving after a request's were taken (`take_rows`) or let go (`drop_rows`) are dropped
during the grace period too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import zmq

from noisy_temp_server.engine_contract.trace_channel import CapturedRows, TraceReport
from noisy_temp_server.engine_contract.trace_wire import DROP_REASONS, decode_rows, decode_trace

__all__ = ["TraceCollector"]

_LOGGER = logging.getLogger(__name__)
_RECEIVE_POLL_MS = 100
_EXPIRY_INTERVAL_S = 1.0
_FORGOTTEN_GRACE_S = 30.0


@dataclass
class _HeldRows:
    rows: dict[int, np.ndarray | None] = field(default_factory=dict)  # None: dropped
    nbytes: int = 0
    last_update: float = field(default_factory=time.monotonic)

    def put(self, step: int, row: np.ndarray | None, now: float) -> int:
        """Hold ``row`` for ``step`` (None: announced dropped, unless a row arrived: V1
        re-captures a chunked prefill's step); the change in bytes held."""
        previous = self.rows.get(step)
        if row is None and previous is not None:
            return 0
        change = (0 if row is None else row.nbytes) - (0 if previous is None else previous.nbytes)
        self.rows[step] = row
        self.nbytes += change
        self.last_update = now
        return change

    def accounted(self, n_steps: int) -> bool:
        return all(step in self.rows for step in range(n_steps))

    def result(self) -> CapturedRows:
        kept = sorted((step, row) for step, row in self.rows.items() if row is not None)
        if not kept:
            return CapturedRows(np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32))
        return CapturedRows(
            np.asarray([step for step, _ in kept], dtype=np.int64),
            np.stack([row for _, row in kept]),
        )


@dataclass
class _PendingTrace:
    temperatures_by_step: dict[int, float] = field(default_factory=dict)
    parts: dict[int, tuple[float, int, float, float]] = field(default_factory=dict)
    last_update: float = field(default_factory=time.monotonic)

    def report(self, n_steps: int) -> TraceReport:
        by_step = self.temperatures_by_step
        trace = tuple(by_step[s] for s in sorted(by_step) if s < n_steps)
        count = sum(part[1] for part in self.parts.values())
        if not count:
            return TraceReport(trace=trace)
        return TraceReport(
            steps=count,
            t_mean=sum(part[0] for part in self.parts.values()) / count,
            t_min=min(part[2] for part in self.parts.values()),
            t_max=max(part[3] for part in self.parts.values()),
            trace=trace,
        )

    def complete(self, n_steps: int, want_trace: bool) -> bool:
        counted = sum(part[1] for part in self.parts.values())
        return counted >= n_steps and (not want_trace or len(self.temperatures_by_step) >= n_steps)


@dataclass
class _Waiter:
    n_steps: int
    want_trace: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


class _RecentIds:
    """Ids let go of lately, each for ``grace_s`` seconds after the last `add` (at most
    ``max_ids``: the oldest go first), so that late messages for them are ignored instead of
    holding memory again. Not thread-safe: used under the collector's lock."""

    def __init__(self, grace_s: float, max_ids: int) -> None:
        self._since: dict[str, float] = {}  # insertion order is time order
        self._grace_s = grace_s
        self._max_ids = max_ids

    def __contains__(self, trace_id: object) -> bool:
        return trace_id in self._since

    def add(self, trace_id: str, now: float) -> None:
        self._since.pop(trace_id, None)  # re-inserted last
        self._since[trace_id] = now
        if len(self._since) > self._max_ids:
            del self._since[next(iter(self._since))]

    def expire(self, now: float) -> None:
        """Let go of the ids added more than ``grace_s`` seconds before ``now``."""
        while self._since:
            first, since = next(iter(self._since.items()))
            if now - since <= self._grace_s:
                break
            del self._since[first]


class TraceCollector:
    """API side: binds a PULL socket and gathers per-step temperatures by trace id.

    A background daemon thread reads the socket. Use as a context manager, or call `start` and
    `close`. `wait_for` is a coroutine (any event loop; the reader thread wakes it).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        ttl_s: float = 600.0,
        max_ids: int = 100_000,
        forgotten_grace_s: float = _FORGOTTEN_GRACE_S,
        rows_ttl_s: float = 120.0,
        max_row_bytes: int = 512 << 20,
        on_rows_dropped: Callable[[str, int], None] | None = None,
    ) -> None:
        """``endpoint``: the address to bind (``ipc://...``; ``tcp://127.0.0.1:*`` picks a free
        port, see `endpoint` after `start`). ``ttl_s``: an id that has not received a record for
        this long is forgotten. ``max_ids``: beyond this many pending ids the oldest are
        forgotten first. ``forgotten_grace_s``: for this long after an id is forgotten, records
        for it are dropped (late reports of a finished or cancelled request). ``rows_ttl_s``,
        ``max_row_bytes``: how long and how many bytes of captured rows are held for
        `take_rows` (the oldest request's rows go first). ``on_rows_dropped(reason, n)``: called
        (from the reader thread) when the count of captured rows dropped for ``reason``
        (`DROP_REASONS`) grows by ``n``, e.g. to add to a metric.
        """
        if ttl_s <= 0 or max_ids <= 0:
            raise ValueError("TraceCollector needs ttl_s > 0 and max_ids > 0.")
        self._requested_endpoint = endpoint
        self.endpoint = endpoint
        self._ttl_s = ttl_s
        self._max_ids = max_ids
        self._pending: dict[str, _PendingTrace] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._forgotten = _RecentIds(forgotten_grace_s, max_ids)
        self._rows_let_go = _RecentIds(forgotten_grace_s, max_ids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self.malformed_messages = 0
        self._held: dict[str, _HeldRows] = {}
        self._held_bytes = 0
        self._rows_ttl_s = rows_ttl_s
        self._max_row_bytes = max_row_bytes
        self._rows_arrived = threading.Condition(self._lock)
        self._drops = dict.fromkeys(DROP_REASONS, 0)
        self._drops_by_sender: dict[str, dict[str, int]] = {}
        self._on_rows_dropped = on_rows_dropped

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
        with self._lock:
            waiters = list(self._waiters.values())
        for waiter in waiters:
            _wake(waiter)

    def __enter__(self) -> TraceCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def wait_for(
        self, trace_id: str, n_steps: int, timeout: float, *, want_trace: bool = False
    ) -> TraceReport:
        """What arrived for ``trace_id`` once its summary covers ``n_steps`` steps (and, with
        ``want_trace``, its trace has ``n_steps`` steps), or after ``timeout`` seconds with what
        arrived by then. The id is forgotten afterwards either way (also when the wait is
        cancelled). Holds no thread."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(n_steps, want_trace, loop, loop.create_future())
        with self._lock:
            pending = self._pending.get(trace_id)
            done = pending is not None and pending.complete(n_steps, want_trace)
            if not done and not self._stop.is_set():
                self._waiters[trace_id] = waiter
        try:
            if not done and not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        finally:  # cancelled waits forget too
            with self._lock:
                pending = self._forget_locked(trace_id)
        return TraceReport() if pending is None else pending.report(n_steps)

    def forget(self, trace_id: str) -> None:
        """Drop what is held for ``trace_id`` and ignore its records for a grace period: for a
        request that ends without `wait_for` (cancelled, or finished with no step). Idempotent;
        a `wait_for` in progress for it returns an empty report at once."""
        with self._lock:
            waiter = self._waiters.get(trace_id)
            self._forget_locked(trace_id)
        if waiter is not None:
            _wake(waiter)

    def take_rows(self, trace_id: str, n_steps: int, timeout: float) -> CapturedRows | None:
        """The captured rows of ``trace_id``, once steps ``0 .. n_steps - 1`` all arrived or
        were announced dropped, or after ``timeout`` seconds with what arrived by then (None:
        nothing). Blocks the calling thread (the shadow scorer's); the rows are no longer held
        afterwards."""
        deadline = time.monotonic() + timeout
        with self._rows_arrived:
            while not self._stop.is_set():
                held = self._held.get(trace_id)
                left = deadline - time.monotonic()
                if (held is not None and held.accounted(n_steps)) or left <= 0:
                    break
                self._rows_arrived.wait(min(left, _RECEIVE_POLL_MS / 1000))
            held = self._pop_rows(trace_id)
            self._rows_let_go.add(trace_id, time.monotonic())  # rows later than the timeout
        return None if held is None else held.result()

    def drop_rows(self, trace_id: str) -> None:
        """Stop holding the captured rows of ``trace_id`` (nobody will take them), and drop
        those that still arrive for it within the grace period (rows in flight when its
        request was cancelled or its scoring refused)."""
        with self._lock:
            self._pop_rows(trace_id)
            self._rows_let_go.add(trace_id, time.monotonic())

    def held_row_bytes(self) -> int:
        """Bytes of captured rows held (for tests and diagnostics)."""
        with self._lock:
            return self._held_bytes

    def _pop_rows(self, trace_id: str) -> _HeldRows | None:
        held = self._held.pop(trace_id, None)
        if held is not None:
            self._held_bytes -= held.nbytes
        return held

    def capture_drops(self) -> dict[str, int]:
        """Captured rows dropped so far, by reason (`DROP_REASONS`): the sum over the engines
        of each one's cumulative counts as its last rows message reported them, and this
        buffer's evictions."""
        with self._lock:
            return dict(self._drops)

    def _count_drops(self, sender: str, counts: Mapping[str, int]) -> list[tuple[str, int]]:
        """Add to the totals what ``sender``'s cumulative ``counts`` grew by since its last
        report (unknown reasons ignored, so labels stay bounded; ``buffer_full`` is counted
        here, not by engines); the increases. Under the lock."""
        previous = self._drops_by_sender.setdefault(sender, {})
        grown = []
        for reason, count in counts.items():
            if reason not in self._drops or reason == "buffer_full":
                continue
            increase = count - previous.get(reason, 0)
            if increase > 0:
                previous[reason] = count
                self._drops[reason] += increase
                grown.append((reason, increase))
        return grown

    def pending_ids(self) -> int:
        """How many trace ids are held (for tests and diagnostics)."""
        with self._lock:
            return len(self._pending)

    def _forget_locked(self, trace_id: str) -> _PendingTrace | None:
        self._waiters.pop(trace_id, None)
        self._forgotten.add(trace_id, time.monotonic())
        return self._pending.pop(trace_id, None)

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
                            parts = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(parts) == 1:
                            self._ingest(parts[0])
                        else:
                            self._ingest_rows(parts)
                now = time.monotonic()
                if now >= next_expiry:
                    self._expire(now)
                    next_expiry = now + _EXPIRY_INTERVAL_S
        finally:
            self._socket.close(linger=0)

    def _ingest(self, message: bytes) -> None:
        try:
            decoded = decode_trace(message)
        except ValueError:
            self.malformed_messages += 1
            return
        steps, parts = decoded.steps, decoded.summaries
        now = time.monotonic()
        woken: list[_Waiter] = []
        with self._lock:
            forgotten = self._forgotten
            touched: set[str] = set()
            for trace_id, step, temperature in steps:
                if trace_id in forgotten:
                    continue
                self._entry(trace_id, now).temperatures_by_step[step] = temperature
                touched.add(trace_id)
            for trace_id, part, total, count, low, high in parts:
                if trace_id not in forgotten and count > 0 and math.isfinite(total):
                    self._entry(trace_id, now).parts[part] = (total, count, low, high)
                    touched.add(trace_id)
            for trace_id in touched:
                waiter = self._waiters.get(trace_id)
                if waiter is not None and self._pending[trace_id].complete(
                    waiter.n_steps, waiter.want_trace
                ):
                    woken.append(waiter)
        for waiter in woken:
            _wake(waiter)

    def _ingest_rows(self, parts: list[bytes]) -> None:
        try:
            message = decode_rows(parts)
        except ValueError:
            self.malformed_messages += 1
            return
        arrived: list[tuple[tuple[str, int], np.ndarray | None]] = [
            *zip(message.captured, message.rows, strict=True),
            *((record, None) for record in message.dropped),
        ]
        now = time.monotonic()
        with self._rows_arrived:
            grown = self._count_drops(message.sender, message.drop_counts)
            for (trace_id, step), row in arrived:
                if trace_id in self._rows_let_go:
                    continue
                held = self._held.get(trace_id)
                if held is None:
                    held = self._held[trace_id] = _HeldRows()
                self._held_bytes += held.put(step, row, now)
            evicted = 0
            while self._held_bytes > self._max_row_bytes:
                oldest = self._pop_rows(next(iter(self._held)))
                evicted += 0 if oldest is None else len(oldest.rows)
            if evicted:
                self._drops["buffer_full"] += evicted
                grown.append(("buffer_full", evicted))
            self._rows_arrived.notify_all()
        if self._on_rows_dropped is not None:
            for reason, count in grown:
                self._on_rows_dropped(reason, count)

    def _entry(self, trace_id: str, now: float) -> _PendingTrace:
        pending = self._pending.get(trace_id)
        if pending is None:
            pending = self._pending[trace_id] = _PendingTrace()
        pending.last_update = now
        return pending

    def _expire(self, now: float) -> None:
        with self._lock:
            self._forgotten.expire(now)
            self._rows_let_go.expire(now)
            stale = [tid for tid, p in self._pending.items() if now - p.last_update > self._ttl_s]
            for trace_id in stale:
                del self._pending[trace_id]
            old_rows = [t for t, h in self._held.items() if now - h.last_update > self._rows_ttl_s]
            for trace_id in old_rows:
                self._pop_rows(trace_id)
            excess = len(self._pending) - self._max_ids
            if excess > 0:
                oldest = sorted(self._pending, key=lambda tid: self._pending[tid].last_update)
                for trace_id in oldest[:excess]:
                    del self._pending[trace_id]


def _wake(waiter: _Waiter) -> None:
    """Resolve ``waiter`` from any thread (a closed loop has nobody left to wake)."""

    def resolve() -> None:
        if not waiter.future.done():
            waiter.future.set_result(None)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to wake
        waiter.loop.call_soon_threadsafe(resolve)
