"""Exit when the engine dies, so that a supervisor restarts the server.

vLLM's engine core runs in its own process; when it dies (killed, out of memory, a fault in a
kernel) `AsyncLLM` is dead for good: every request in flight fails with `EngineDeadError` (the
HTTP layer answers 503, see `server.errors`), `/health` answers 503, and nothing short of a new
process serves again. Restarting the engine inside the process is not attempted: the dead
engine's memory, sockets and trace channel would have to be torn down and rebuilt while
requests arrive, and a fresh process (Docker's restart policy, a Kubernetes liveness probe, any
supervisor, with their back-off) gives a clean state for less code and fewer ways to fail.

`EngineWatchedServer` is uvicorn's server plus a watchdog task: every `interval_s` it asks the
engine `check_health()`; on the first failure it logs the cause, keeps serving for `drain_s`
(every request, `/health` included, answers 503, so probes and load balancers see the server
unhealthy rather than a refused connection), then asks uvicorn to shut down (`should_exit`:
stop accepting, let the requests in flight finish, which they do at once since they fail with
the engine), and forces the exit after `grace_s` more if connections linger.
`engine_failure` then tells the caller (`serve`) to exit non-zero. The watchdog also catches a
death that no request noticed (an idle server), and one noticed only inside a stream, whose
error went to the client in-band after its 200.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from noisy_temp_server.server.engine import GenerationEngine

__all__ = ["EngineWatchedServer"]

_LOGGER = logging.getLogger(__name__)


class EngineWatchedServer(uvicorn.Server):
    """uvicorn's `Server` that shuts down when `engine.check_health()` fails.

    Bounded exit: at most `interval_s` to notice, `drain_s` answering 503, then `grace_s` for
    connections to close, then the app's lifespan shutdown.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        engine: GenerationEngine,
        *,
        interval_s: float = 1.0,
        drain_s: float = 3.0,
        grace_s: float = 10.0,
    ) -> None:
        super().__init__(config)
        self._engine = engine
        self._interval_s = interval_s
        self._drain_s = drain_s
        self._grace_s = grace_s
        self.engine_failure: BaseException | None = None
        """Why the engine failed (the server then shut down), or None."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        watchdog = asyncio.create_task(self._watch(), name="nts-engine-watchdog")
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    async def _watch(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(self._interval_s)
            try:
                await self._engine.check_health()
            except Exception as error:
                self.engine_failure = error
                break
        else:
            return
        _LOGGER.error(
            "The engine failed (%s: %s); answering 503 for %.0f s, then shutting down so that "
            "a supervisor restarts the server (forced %.0f s later if connections linger)",
            type(self.engine_failure).__name__,
            self.engine_failure,
            self._drain_s,
            self._grace_s,
        )
        await asyncio.sleep(self._drain_s)
        self.should_exit = True
        await asyncio.sleep(self._grace_s)
        self.force_exit = True
