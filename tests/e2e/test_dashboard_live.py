"""The status page in a real headless chromium against a real `serve` (vLLM on CPU, the tiny
Llama perturbed by weight noise, the clean tiny Llama as the shadow scorer's reference), after
some traffic: the key is entered in the page's form, the charts have data, and new traffic shows
up in the live KL chart. A screenshot goes to the test's folder and to
benchmarks/results/dashboard.png for a person to look at.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser_helpers import Browser, chromium_executable
from server_helpers import free_port, running_server
from tiny_serve import SCORE_EVERY_REQUEST

pytestmark = pytest.mark.vllm

API_KEY = "dashboard-key"
MODEL = "tiny-noisy"
STARTUP_TIMEOUT_S = 420
SHADOW_TIMEOUT_S = 300
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
STATUS = "document.getElementById('status').dataset.state"
STEP_POINTS = "Number(document.getElementById('chart-steps').dataset.points)"
KL_POINTS = "Number(document.getElementById('chart-kl').dataset.points)"


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec  # noqa: PLC0415
    from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint  # noqa: PLC0415

    work = tmp_path_factory.mktemp("dashboard-server")
    served = ensure_perturbed_checkpoint(tiny_model_dir, WeightNoiseSpec(scale=0.3), work)
    port = free_port()
    command = [
        sys.executable, "-m", "noisy_temp_server.cli", "serve", "--enforce-eager",
        "--served-model", str(served),
        "--clean-model", str(tiny_model_dir),
        "--served-model-name", MODEL,
        "--cache-dir", str(work),
        "--port", str(port),
        "--api-key", API_KEY,
        "--max-model-len", "256",
        "--max-num-seqs", "8",
        "--kv-cache-gib", "1",
        *SCORE_EVERY_REQUEST,
        "--shadow-min-positions", "32",
    ]  # fmt: skip
    with running_server(
        "server /health", command, port=port, log=work / "server.log", timeout_s=STARTUP_TIMEOUT_S
    ) as url:
        yield url


def shadow_status(url: str) -> dict[str, Any]:
    response = httpx.get(
        f"{url}/v1/nts/status", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()["shadow"]  # type: ignore[no-any-return]


def send_traffic(url: str, seeds: range) -> None:
    """Completions at a fixed T* and under the policy in force; waits until all are scored."""
    scored_before = shadow_status(url)["scored"]
    with httpx.Client(base_url=url, timeout=120) as client:
        for seed in seeds:
            extra = {"nts_rule": "fixed", "nts_t": 1.3} if seed % 2 == 0 else {}
            body = {
                "model": MODEL,
                "prompt": f"The status page shows request {seed}:",
                "max_tokens": 40,
                "temperature": 1.0,
                "seed": seed,
                **extra,
            }
            response = client.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert response.status_code == 200, response.text
    deadline = time.monotonic() + SHADOW_TIMEOUT_S
    while shadow_status(url)["scored"] < scored_before + len(seeds):
        assert time.monotonic() < deadline, f"shadow scoring not done: {shadow_status(url)}"
        time.sleep(1.0)


def test_the_page_shows_live_data_after_traffic(server_url: str, tmp_path: Path) -> None:
    send_traffic(server_url, range(4))
    with Browser(chromium_executable(), tmp_path) as browser:
        browser.open(server_url)
        browser.wait_for(f"{STATUS} === 'unauthorized'", 30)
        browser.evaluate(
            f"document.getElementById('api-key').value = {API_KEY!r};"
            "document.getElementById('key-form').requestSubmit(); true"
        )
        browser.wait_for(f"{STATUS} === 'ok'", 30)
        assert API_KEY not in browser.evaluate("location.href")
        table = browser.evaluate("document.getElementById('bucket-table').innerText")
        assert "1.30" in table  # the fixed rule's T*, applied at every step
        assert browser.wait_for(KL_POINTS, 30) >= 2  # KL at T = 1 and at the served T*
        shadow = browser.evaluate("document.getElementById('shadow-facts').innerText")
        assert "ms per scored token" in shadow

        for wave in (range(4, 7), range(7, 10)):  # new traffic: new points on the KL chart
            points = browser.evaluate(KL_POINTS)
            send_traffic(server_url, wave)
            browser.wait_for(f"{KL_POINTS} >= {points + 2}", 60)
        # The estimator has published: α by the policy's buckets, and the T* applied in them
        # (the chart leaves out buckets of the identity policy the first wave ran under).
        browser.wait_for(
            "document.getElementById('chart-steps').innerText.includes('T* (fixed)')", 30
        )
        assert browser.evaluate(STEP_POINTS) >= 8  # α and T* (fixed), 2+ buckets, 2 ends each
        picture = browser.screenshot(tmp_path / "dashboard.png")
    RESULTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(picture, RESULTS / "dashboard.png")
