"""The status page in a real headless chromium against the app with a stand-in engine (no vLLM
engine starts): the API key is asked for once and a wrong one is named, a dead engine is named,
the charts draw what the registry holds, and the adapter is shown with its calibration figures.
Seconds, not minutes; the page with a real engine and real traffic is `test_dashboard_live.py`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from browser_helpers import Browser, chromium_executable
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from server_helpers import free_port

from noisy_temp_server.adapter.serving import CalibratedKl, ServedAdapter
from noisy_temp_server.online.policy_source import StaticPolicySource
from noisy_temp_server.server.app import create_app
from noisy_temp_server.server.metrics import ApiMetrics
from noisy_temp_server.settings import Settings
from noisy_temp_server.step.engine_metrics import StepTemperatureMetrics
from noisy_temp_server.temperature.policy import TemperaturePolicy

API_KEY = "page-key"
POLICY = TemperaturePolicy(
    version=3,
    rule="sqrt",
    step_edges=(0, 8, 32),
    alpha_by_step=(0.04, 0.09, 0.16),
    sigma2_by_step=(0.4, 0.9, 1.6),
)
ADAPTER_KL = CalibratedKl(without_adapter=0.5, with_adapter=0.2)
STATUS = "document.getElementById('status').dataset.state"
STEP_POINTS = "Number(document.getElementById('chart-steps').dataset.points)"
KL_POINTS = "Number(document.getElementById('chart-kl').dataset.points)"


class StandInEngine:
    """Only health: these tests send no completions."""

    def __init__(self) -> None:
        self.dead = False

    def generate(self, *_: Any) -> AsyncIterator[Any]:
        raise NotImplementedError

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine core died")


class NoTokenizer:
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def apply_chat_template(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, StandInEngine]]:
    """The app on loopback, its registry holding T* by step bucket and shadow KL."""
    registry = CollectorRegistry()
    metrics = ApiMetrics(registry)
    steps = StepTemperatureMetrics(registry)
    for label, value in zip(["0-7", "8-31", "32+"], [1.1, 1.2, 1.3], strict=True):
        steps.histogram.labels(step_bucket=label, rule="sqrt").observe(value)
    for value in (0.2, 0.3):
        metrics.online.shadow_kl.labels(temperature="one").observe(value)
        metrics.online.shadow_kl.labels(temperature="served").observe(value / 2)
    engine = StandInEngine()
    app = create_app(
        Settings(api_key=SecretStr(API_KEY)),
        engine,  # type: ignore[arg-type]
        tokenizer=NoTokenizer(),
        model_name="stand-in",
        max_model_len=64,
        policy_source=StaticPolicySource(POLICY, "test profile"),
        metrics=metrics,
        metrics_registry=registry,
        trace_source=None,
        adapter=ServedAdapter(
            "ab" * 32, "folded", Path("/adapters/adapter-abab"), 16, "stand-in", ADAPTER_KL
        ),
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with Browser(chromium_executable(), tmp_path) as opened:
        yield opened


def enter_key(browser: Browser, key: str) -> None:
    browser.wait_for("!document.getElementById('key-form').hidden", 15)
    browser.evaluate(
        f"document.getElementById('api-key').value = {key!r};"
        "document.getElementById('key-form').requestSubmit(); true"
    )


def test_the_page_asks_for_the_key_and_names_a_wrong_one(
    served: tuple[str, StandInEngine], browser: Browser
) -> None:
    url, _ = served
    browser.open(f"{url}/dashboard")
    assert browser.wait_for(f"{STATUS} === 'unauthorized' && {STATUS}", 15)
    assert "needs its API key" in browser.evaluate("document.body.innerText")
    enter_key(browser, "not-the-key")
    browser.wait_for("document.getElementById('key-message').textContent.includes('401')", 15)
    assert browser.evaluate(STATUS) == "unauthorized"
    assert "refused" in browser.evaluate("document.getElementById('banner').textContent")


def test_with_the_key_the_charts_draw_the_registry(
    served: tuple[str, StandInEngine], browser: Browser
) -> None:
    url, _ = served
    browser.open(url)
    enter_key(browser, API_KEY)
    browser.wait_for(f"{STATUS} === 'ok'", 15)
    assert API_KEY not in browser.evaluate("location.href")
    assert browser.evaluate("sessionStorage.getItem('nts-api-key')") == API_KEY
    # x: each bucket's first and last step (0, 7, 8, 31, 32, and 56 for the open bucket
    # "32+"); α and T* (sqrt) at each.
    assert browser.evaluate(STEP_POINTS) == 12
    assert browser.evaluate(KL_POINTS) == 2  # one history point: KL at T = 1 and at T*
    assert browser.evaluate("document.getElementById('policy-version').textContent") == "3"
    table = browser.evaluate("document.getElementById('bucket-table').innerText")
    assert "8-31" in table
    assert "0.0900" in table
    kl = browser.evaluate("document.getElementById('kl-facts').innerText")
    assert "0.250" in kl  # mean of 0.2 and 0.3
    assert "0.125" in kl
    policy = browser.evaluate("document.getElementById('policy-facts').innerText")
    assert "folded into the weights · rank 16 · abababababab…" in policy
    assert "KL 0.500 → 0.200 (60 % removed)" in policy
    # The key is asked for once: a reload in the same tab goes straight to the data.
    browser.open(url)
    browser.wait_for(f"{STATUS} === 'ok'", 15)


def test_a_dead_engine_is_named(served: tuple[str, StandInEngine], browser: Browser) -> None:
    url, engine = served
    browser.open(url)
    enter_key(browser, API_KEY)
    browser.wait_for(f"{STATUS} === 'ok'", 15)
    engine.dead = True
    try:
        browser.open(url)
        browser.wait_for(f"{STATUS} === 'engine-down'", 15)
        banner = browser.evaluate("document.getElementById('banner').innerText")
        assert "engine is down" in banner
        assert "503" in banner
        assert "engine core died" in banner
    finally:
        engine.dead = False
