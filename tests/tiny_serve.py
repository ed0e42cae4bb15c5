"""`noisy-temp-server serve` in a subprocess on the tiny model (real vLLM on CPU), for the
end-to-end tests that need a whole server: its engine core can be killed, its /openapi.json
fuzzed. Shares the polling and stopping of `server_helpers`."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from server_helpers import free_port, start_server

__all__ = ["API_KEY", "MODEL", "SCORE_EVERY_REQUEST", "TinyServer", "start_tiny_server"]

API_KEY = "e2e-key"
MODEL = "tiny-noisy"
SCORE_EVERY_REQUEST = (
    *("--shadow-fraction", "1"),
    *("--shadow-cpu-share", "1", "--shadow-warmup-cpu-share", "1"),
)
"""`serve` flags that shadow-score every request (sampling fraction 1, no CPU budget)."""
STARTUP_TIMEOUT_S = 420.0
_SERVE = (
    "import sys\nfrom noisy_temp_server.cli import main\nsys.exit(main(['serve', *sys.argv[1:]]))\n"
)
"""`noisy-temp-server serve` as the console script runs it (vLLM's engine flags included)."""


@dataclass(frozen=True)
class TinyServer:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


def start_tiny_server(tiny_model_dir: Path, workdir: Path, *extra: str) -> TinyServer:
    """Serve the tiny Llama perturbed by weight noise (the clean one as the shadow reference),
    with the API key `API_KEY`; return once /health answers 200."""
    from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec  # noqa: PLC0415
    from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint  # noqa: PLC0415

    served = ensure_perturbed_checkpoint(tiny_model_dir, WeightNoiseSpec(scale=0.3), workdir)
    port = free_port()
    log_path = workdir / "server.log"
    command = [
        sys.executable, "-c", _SERVE,
        "--served-model", str(served),
        "--clean-model", str(tiny_model_dir),
        "--served-model-name", MODEL,
        "--cache-dir", str(workdir),
        "--port", str(port),
        "--api-key", API_KEY,
        "--max-model-len", "256",
        "--max-num-seqs", "8",
        "--kv-cache-gib", "1",
        "--log-level", "info",
        "--enforce-eager",  # tests start fast; the default compiles (docs/serving.md)
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process, url = start_server(
        "serve", command, port=port, log=log_path, timeout_s=STARTUP_TIMEOUT_S, env=env
    )
    return TinyServer(process, url, log_path)
