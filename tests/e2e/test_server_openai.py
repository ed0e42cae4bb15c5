"""End to end: `serve` in a subprocess with real vLLM on CPU and the tiny model, driven through
the `openai` client.

One server for the module (one engine start): the tiny Llama perturbed by weight noise is served,
the clean tiny Llama is the shadow scorer's reference, every finished request is scored
(fraction 1.0) and the estimator publishes after little evidence, so the policy version moves
within the module.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import stop
from tiny_serve import API_KEY, MODEL, SCORE_EVERY_REQUEST, start_tiny_server

pytestmark = pytest.mark.vllm


def _descendants(pid: int) -> set[int]:
    """Process ids below `pid` (Linux /proc)."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.add(child)
            pending.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


@pytest.fixture(scope="module")
def base_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny server, every request shadow-scored; its engine processes must not outlive it."""
    workdir = tmp_path_factory.mktemp("serve-cache")
    server = start_tiny_server(
        tiny_model_dir, workdir, *SCORE_EVERY_REQUEST, "--shadow-min-positions", "32"
    )
    engine_processes = _descendants(server.process.pid)
    try:
        yield server.url
    finally:
        stop(server.process)
    deadline = time.monotonic() + 30
    while _alive(engine_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    leftover = _alive(engine_processes)
    for pid in leftover:
        os.kill(pid, 9)
    assert not leftover, f"engine processes outlived the server: {leftover}"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _nts(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    assert "nts" in extra, f"no nts extension in {obj}"
    return dict(extra["nts"])


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_with_usage_and_summary(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 8
    nts = _nts(response)
    assert nts["steps"] == 8
    assert isinstance(nts["policy_version"], int)


def test_fixed_rule_reports_its_temperature_exactly(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        extra_body={"ignore_eos": True, "nts_rule": "fixed", "nts_t": 1.5, "nts_trace": True},
    )
    nts = _nts(response)
    assert nts["rule"] == "fixed"
    assert nts["t_mean"] == pytest.approx(1.5)
    assert nts["t_min"] == pytest.approx(1.5)
    assert nts["t_max"] == pytest.approx(1.5)
    assert nts["trace"] == pytest.approx([1.5] * 6)
    choice_nts = _nts(response.choices[0])
    assert choice_nts["trace"] == pytest.approx([1.5] * 6)


def test_logprobs_reflect_the_tuned_temperature(client: openai.OpenAI) -> None:
    def top_two_gap(extra: dict[str, Any]) -> float:
        response = client.completions.create(
            model=MODEL, prompt="Hello! How can I", max_tokens=1, logprobs=5, seed=3,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip
        logprobs = response.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.top_logprobs
        ranked = sorted(logprobs.top_logprobs[0].values(), reverse=True)
        return ranked[0] - ranked[1]

    plain = top_two_gap({"nts_rule": "off"})
    hot = top_two_gap({"nts_rule": "fixed", "nts_t": 2.0})
    assert plain > 0
    assert hot == pytest.approx(plain / 2.0, rel=1e-3)


def test_greedy_requests_report_t_one(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="Question:", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "nts_rule": "fixed", "nts_t": 3.0},
    )  # fmt: skip
    nts = _nts(response)
    assert (nts["rule"], nts["t_mean"], nts["t_min"], nts["t_max"]) == ("off", 1.0, 1.0, 1.0)


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What colour is the sky?"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    message = response.choices[0].message
    assert message.role == "assistant"
    assert isinstance(message.content, str)
    assert response.usage is not None
    assert response.usage.completion_tokens == 5
    assert _nts(response)["steps"] == 5


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count: one, two,"}],
        "max_tokens": 6,
        "seed": 5,
        "extra_body": {"ignore_eos": True, "nts_rule": "fixed", "nts_t": 1.25},
    }
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert _nts(chunks[-1])["t_mean"] == pytest.approx(1.25)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing[-1].choices[0].finish_reason == "length"
    whole = client.chat.completions.create(**request)  # same seed: the same sample
    assert text == whole.choices[0].message.content


def test_streaming_completion_n2(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=4, n=2, seed=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    indices = {c.choices[0].index for c in chunks if c.choices}
    assert indices == {0, 1}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_n_choices_each_carry_a_summary(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=3, n=3, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(_nts(c)["steps"] == 3 for c in response.choices)
    assert _nts(response)["steps"] == 9


def test_stop_strings_end_the_completion(client: openai.OpenAI) -> None:
    prompt = "Temperature scaling divides"
    full = (
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    assert len(full) >= 4
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    stopped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.find(stop)]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    client: openai.OpenAI, base_url: str
) -> None:
    def ok() -> None:
        response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert response.choices

    ok()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=5)
    ok()
    with pytest.raises(openai.BadRequestError, match="not a rule"):
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=2, extra_body={"nts_rule": "hot"}
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="Hello " * 300, max_tokens=2)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=2)
    unauthenticated = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthenticated.models.list()
    malformed = httpx.post(
        f"{base_url}/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert malformed.status_code == 400
    assert set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    ok()


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)}(?:{{[^}}]*}})? (\S+)$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    return math.fsum(values) if values else float("nan")


def test_metrics_after_traffic(client: openai.OpenAI, base_url: str) -> None:
    client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, extra_body={"nts_rule": "fixed", "nts_t": 1.5}
    )
    text = httpx.get(f"{base_url}/metrics").text
    assert _metric(text, "nts_http_requests_total") > 0
    assert _metric(text, "nts_request_temperature_mean_count") > 0
    assert _metric(text, "nts_step_temperature_count") > 0  # engine process, multiprocess dir
    assert _metric(text, "vllm:request_success_total") > 0
    assert not math.isnan(_metric(text, "nts_policy_version"))
    for name in ("nts_alpha", "nts_sigma2", "nts_shadow_requests_dropped_total"):
        assert name in text


def test_shadow_scorer_moves_the_policy_version(client: openai.OpenAI, base_url: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    start = httpx.get(f"{base_url}/v1/nts/status", headers=headers).json()["policy_version"]
    deadline = time.monotonic() + 180
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        client.completions.create(
            model=MODEL, prompt="A noisy model is served", max_tokens=16,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        status = httpx.get(f"{base_url}/v1/nts/status", headers=headers).json()
        if status["policy_version"] > start:
            break
        time.sleep(1.0)
    assert status["policy_version"] > start, status
    assert status["shadow"]["scored"] > 0
    assert status["alpha_by_step_bucket"]
    text = httpx.get(f"{base_url}/metrics").text
    assert _metric(text, "nts_shadow_requests_scored_total") > 0
    assert _metric(text, "nts_shadow_tokens_scored_total") > 0
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert _nts(response)["policy_version"] == status["policy_version"]
