"""The remote clean backend against two real servers on CPU: a stock vLLM OpenAI server serving
the clean tiny model (started as vLLM documents it, with `--max-logprobs -1`) and a
`noisy-temp-server serve` replica that scores its sampled requests against it.

Tolerance: the remote rows are vLLM's float32 CPU log-probabilities, the in-process ones
transformers' float32 logits of the same weights; every statistic agrees to 1e-3 relative +
1e-4 absolute (observed differences are about 1e-5).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import free_port, running_server, stop, wait_until
from tiny_model import TINY_VOCAB_SIZE

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec, apply_perturbation
from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint
from noisy_temp_server.scoring.clean_backend import InProcessModel, RemoteClean
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import PairScorer, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 600
SCORED_TIMEOUT_S = 300
RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def clean_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model_dir), "--served-model-name", "clean",
        "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "256",
        "--dtype", "float32", "--enforce-eager", "--max-logprobs", "-1",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path_factory.mktemp("clean-vllm") / "server.log"
    with running_server(
        "clean vLLM server", command, port=port, log=log, timeout_s=START_TIMEOUT_S, env=env
    ) as url:
        yield url


def _sequences() -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(3)
    return [
        ScoringSequence(torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=generator).tolist(), p, i)
        for i, (n, p) in enumerate([(40, 8), (17, 12), (90, 30)])
    ]


def test_remote_clean_gives_the_in_process_statistics(
    clean_server: str, tiny_model_dir: Path
) -> None:
    clean, _ = load_causal_lm(tiny_model_dir)
    served = copy.deepcopy(clean)
    apply_perturbation(served, WeightNoiseSpec(scale=0.3, seed=1))
    remote = RemoteClean(clean_server, "clean", TINY_VOCAB_SIZE)
    try:
        for sequence in _sequences():
            trace = [1.2] * 10
            rows = torch.cat(list(InProcessModel(served).completion_rows(sequence, 64)))
            captured = ServedRows(torch.arange(rows.shape[0]), rows)
            local = PairScorer(clean, chunk_positions=16).score_live(
                sequence, trace, captured, request_temperature=1.0
            )
            far = PairScorer(remote, chunk_positions=16).score_live(
                sequence, trace, captured, request_temperature=1.0
            )
            for name in PositionRecords._row_fields():
                if name in ("oracle_t", "oracle_kl"):
                    continue
                expected, actual = getattr(local.records, name), getattr(far.records, name)
                if name == "same_top":
                    assert torch.equal(actual, expected)
                else:
                    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=name)
            for part in ("at_one", "at_served"):
                for name in ("kld", "delta_p", "log_ratio"):
                    torch.testing.assert_close(
                        getattr(getattr(far, part), name),
                        getattr(getattr(local, part), name),
                        rtol=RTOL,
                        atol=ATOL,
                    )
            assert float(local.records.kl_at_one.mean()) > 0.01  # the pair differs
        status = remote.status()
        assert (status["requests"], status["failures"], status["healthy"]) == (3, 0, True)
    finally:
        remote.close()


def test_a_served_replica_scores_against_the_remote_clean_server(
    clean_server: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    served = ensure_perturbed_checkpoint(
        tiny_model_dir, WeightNoiseSpec(scale=0.3, seed=1), tmp_path / "models"
    )
    port = free_port()
    env = {
        **os.environ,
        "NTS_HOST": "127.0.0.1",
        "NTS_PORT": str(port),
        "NTS_CACHE_DIR": str(tmp_path / "cache"),
        "NTS_SERVED_MODEL": str(served),
        "NTS_SERVED_MODEL_NAME": "tiny",
        "NTS_CLEAN_BACKEND": "remote",
        "NTS_CLEAN_URL": clean_server,
        "NTS_CLEAN_REMOTE_MODEL": "clean",
        "NTS_SHADOW_FRACTION": "1.0",
        "NTS_SHADOW_CPU_SHARE": "1",  # no CPU budget: every request is scored
        "NTS_SHADOW_WARMUP_CPU_SHARE": "1",
        "NTS_SHADOW_MIN_POSITIONS": "32",
        "NTS_KV_CACHE_GIB": "1",
        "NTS_MAX_MODEL_LEN": "256",
        "NTS_DTYPE": "float32",
    }
    env.pop("NTS_CLEAN_MODEL", None)
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "noisy_temp_server.cli", "serve", "--enforce-eager"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            "served replica",
            START_TIMEOUT_S,
            lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
            process,
            log,
        )
        for seed in range(4):
            body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 16, "seed": seed}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        deadline = time.monotonic() + SCORED_TIMEOUT_S
        while True:
            shadow = httpx.get(f"{url}/v1/nts/status", timeout=10).json()["shadow"]
            if shadow["scored"] + shadow["dropped_error"] >= 4 or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert shadow["scored"] == 4, shadow
        clean = shadow["clean_backend"]
        assert (clean["kind"], clean["url"], clean["failures"]) == ("remote", clean_server, 0)
        assert clean["requests"] == 4
    finally:
        stop(process)
