"""The HTTP layer with a fake engine: protocol conversion, the nts summary, errors, metrics.

The fake engine has AsyncLLM's `generate()` async-iterator interface and produces one token per
step (ids counting up from the prompt length), so every test runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from server_fakes import (
    MAX_MODEL_LEN,
    MODEL,
    POLICY,
    VOCAB,
    FakeTokenizer,
    FakeTraces,
    Harness,
    assert_error,
    build,
    sse_events,
)

from noisy_temp_server.engine_contract.trace_channel import TraceReport
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


# ----------------------------------------------------------------------------- completions


def test_completion_reports_tokens_usage_and_the_temperature_summary(server: Harness) -> None:
    response = server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " t3 t4 t5"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    nts = body["nts"]
    assert nts["rule"] == "sqrt"
    assert nts["policy_version"] == 7
    assert nts["alpha"] == pytest.approx(0.5625)
    assert (nts["t_mean"], nts["t_min"], nts["t_max"]) == (1.25, 1.25, 1.25)
    assert nts["steps"] == 3
    assert nts["trace"] is None
    assert body["choices"][0]["nts"]["t_mean"] == 1.25


def test_engine_request_carries_the_pinned_policy_and_a_trace_id(server: Harness) -> None:
    server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "temperature": 0.5})
    ((_, params, request_id),) = server.engine.calls
    extra = params.extra_args or {}
    assert TemperaturePolicy.from_json(extra["nts_policy"]) == POLICY
    assert extra["nts_trace_id"] == request_id
    assert params.temperature == 0.5
    assert server.traces.waited == [(request_id, 2)]


def test_fixed_rule_override_reports_its_rule_and_asked_trace(server: Harness) -> None:
    server.traces.temperature = 1.5
    response = server.post(
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 4, "nts_rule": "fixed", "nts_t": 1.5, "nts_trace": True},
    )
    body = response.json()
    nts = body["choices"][0]["nts"]
    assert nts["rule"] == "fixed"
    assert nts["trace"] == [1.5] * 4
    assert body["nts"]["trace"] == [1.5] * 4
    extra = server.engine.calls[0][1].extra_args or {}
    assert (extra["nts_rule"], extra["nts_t"], extra["nts_trace"]) == ("fixed", 1.5, True)


def test_vllm_xargs_carry_the_same_keys(server: Harness) -> None:
    response = server.post(
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 1, "vllm_xargs": {"nts_rule": "linear", "nts_t_max": 2}},
    )
    assert response.json()["nts"]["rule"] == "linear"
    assert (server.engine.calls[0][1].extra_args or {})["nts_t_max"] == 2


@pytest.mark.parametrize(
    "body",
    [
        {"temperature": 0},
        {"nts_tune": False},
        {"nts_rule": "off"},
        {"vllm_xargs": {"nts_tune": "false"}},
    ],
)
def test_greedy_and_untuned_requests_report_t_one(server: Harness, body: dict[str, Any]) -> None:
    response = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, **body})
    nts = response.json()["nts"]
    assert nts["rule"] == "off"
    assert (nts["t_mean"], nts["t_min"], nts["t_max"]) == (1.0, 1.0, 1.0)
    assert server.traces.waited == []
    assert "nts_trace_id" not in (server.engine.calls[0][1].extra_args or {})


def test_the_nts_object_names_the_policys_bias() -> None:
    """Greedy requests get the correction too (it changes their output); `nts_bias` false
    takes it away."""
    bias = "ab" * 32
    corrected = TemperaturePolicy(version=3, rule="fixed", bias=bias)
    server = build(Settings(), corrected)
    for body in ({}, {"temperature": 0}):
        response = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, **body})
        assert response.status_code == 200, response.text
        assert response.json()["nts"]["bias"] == bias
        assert response.json()["choices"][0]["nts"]["bias"] == bias
    streamed = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream": True})
    final = [e for e in sse_events(streamed) if e != "[DONE]"][-1]
    assert final["nts"]["bias"] == bias
    off = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "nts_bias": False})
    assert off.json()["nts"]["bias"] is None


def test_a_tiny_temperature_is_tuned_as_the_engine_samples_it(server: Harness) -> None:
    """vLLM raises 0 < T < 0.01 to 0.01 and samples: the row is tuned, so it is reported."""
    response = server.post(
        "/v1/completions", {"prompt": "abc", "max_tokens": 2, "n": 2, "temperature": 5e-6}
    )
    assert response.status_code == 200, response.text
    assert response.json()["nts"]["rule"] == "sqrt"
    assert all("nts_trace_id" in (c[1].extra_args or {}) for c in server.engine.calls)
    assert len(server.traces.waited) == 2


def test_n_greedy_choices_are_a_400(server: Harness) -> None:
    body = {"prompt": "abc", "n": 2, "temperature": 0}
    error = assert_error(server.post("/v1/completions", body), 400)
    assert error["param"] == "n"
    assert server.engine.calls == []


def test_n_choices_run_as_separate_seeded_engine_requests(server: Harness) -> None:
    response = server.post(
        "/v1/completions",
        {"prompt": "ab", "max_tokens": 2, "n": 3, "seed": 5, "nts_trace": True},
    )
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["nts"]["trace"] is None
    assert all(c["nts"]["steps"] == 2 for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert body["nts"]["steps"] == 6
    seeds = sorted(params.seed for _, params, _ in server.engine.calls)
    assert seeds == [5, 6, 7]
    trace_ids = {(params.extra_args or {})["nts_trace_id"] for _, params, _ in server.engine.calls}
    assert len(trace_ids) == 3


def test_default_max_tokens_fill_the_context(server: Harness) -> None:
    server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    ((prompt, params, _),) = server.engine.calls
    assert params.max_tokens == MAX_MODEL_LEN - len(prompt)


def test_completion_logprobs(server: Harness) -> None:
    response = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "logprobs": 1})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" t3", " t4"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {" t3": -0.5, " t4": -9999.0}
    assert logprobs["text_offset"] == [0, 3]


def test_streamed_completion_ends_with_usage_and_summary(server: Harness) -> None:
    response = server.post(
        "/v1/completions",
        {
            "prompt": "abc",
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        assert "usage" not in chunk  # as vLLM's server
        assert (choice["nts"] is not None) == (choice["finish_reason"] is not None)
    assert texts == {0: " t3 t4 t5", 1: " t3 t4 t5"}
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 6
    assert final["nts"]["t_mean"] == 1.25


def test_stream_without_include_usage_has_no_usage(server: Harness) -> None:
    response = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream": True})
    chunks = [e for e in sse_events(response) if e != "[DONE]"]
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["nts"]["rule"] == "sqrt"


# ----------------------------------------------------------------------------- chat


def test_chat_uses_the_chat_template(server: Harness) -> None:
    response = server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 1,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    expected = FakeTokenizer().encode("<user>hi<assistant>")
    assert server.engine.calls[0][0] == expected
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": f" t{len(expected)} t{len(expected) + 1}",
        "reasoning": None,  # as vLLM's: null without a reasoning parser
    }
    content = choice["logprobs"]["content"]
    assert content[0]["logprob"] == -0.5
    assert [t["token"] for t in content[0]["top_logprobs"]] == [f" t{len(expected)}"]
    assert choice["nts"]["rule"] == "sqrt"


def test_streamed_chat_starts_with_the_role_and_ends_with_the_summary(server: Harness) -> None:
    response = server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [e for e in sse_events(response) if e != "[DONE]"]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    content = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[1:-1])
    assert content.count(" t") == 2
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-1]["nts"]["steps"] == 2


def test_chat_without_template_is_a_400() -> None:
    templateless = build(Settings(), POLICY, tokenizer=FakeTokenizer(chat_template=None))
    response = templateless.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]
    assert templateless.engine.calls == []


def _disconnect_mid_generation(server: Harness, request: dict[str, Any]) -> float:
    """Drive the ASGI app directly: after the body, the client disconnects mid-generation.
    Returns how long the app took to finish."""
    server.engine.step_seconds = 0.05
    body = json.dumps(request).encode()
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    return asyncio.run(_timed(server.client.app(scope, receive, send)))  # type: ignore[arg-type]


def test_a_client_disconnect_aborts_its_non_streaming_request(server: Harness) -> None:
    elapsed = _disconnect_mid_generation(server, {"prompt": "abc", "max_tokens": 40, "n": 2})
    assert elapsed < 1.0  # 40 steps of 50 ms would take 2 s
    assert sorted(server.engine.aborted) == sorted(c[2] for c in server.engine.calls)
    assert len(server.engine.aborted) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_cancelled_request_tells_the_trace_channel_to_forget_its_choices(
    server: Harness, stream: bool
) -> None:
    request = {"prompt": "abc", "max_tokens": 40, "n": 2, "stream": stream}
    _disconnect_mid_generation(server, request)
    trace_ids = sorted(c[2] for c in server.engine.calls)
    assert len(trace_ids) == 2
    assert sorted(server.traces.forgotten) == trace_ids
    assert server.traces.waited == []


def test_finished_choices_are_not_forgotten_twice(server: Harness) -> None:
    for stream in (False, True):
        body = {"prompt": "abc", "max_tokens": 3, "n": 2, "stream": stream}
        assert server.post("/v1/completions", body).status_code == 200
    assert len(server.traces.waited) == 4  # wait_for forgets each of them itself
    assert server.traces.forgotten == []


async def _timed(work: Any) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await work
    return loop.time() - started


class _SlowTokenizer(FakeTokenizer):
    """Tokenizing blocks its thread for `seconds`, as a megabyte prompt does a real one."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.calls = 0
        self.finished = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        time.sleep(self.seconds)
        self.finished += 1
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completions", "chat"],
)
def test_tokenizing_a_prompt_does_not_stall_the_other_requests(
    path: str, body: dict[str, Any]
) -> None:
    tokenizer = _SlowTokenizer(seconds=1.0)
    app = build(Settings(), POLICY, tokenizer=tokenizer).client.app

    async def health_while_tokenizing() -> tuple[int, int, int]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            generation = asyncio.create_task(client.post(path, json=body))
            while tokenizer.calls == 0:  # on the event loop, this ends after tokenizing
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            tokenized_before_health = tokenizer.finished
            return health.status_code, tokenized_before_health, (await generation).status_code

    health_status, tokenized_before_health, generation_status = asyncio.run(
        health_while_tokenizing()
    )
    assert (health_status, generation_status) == (200, 200)
    assert tokenized_before_health == 0  # /health was answered while the prompt was tokenized


def test_an_unknown_model_is_refused_before_the_prompt_is_tokenized() -> None:
    tokenizer = _SlowTokenizer(seconds=0.0)
    server = build(Settings(), POLICY, tokenizer=tokenizer)
    assert_error(server.post("/v1/completions", {"model": "gpt-5", "prompt": "a"}), 404)
    assert tokenizer.calls == 0


# ----------------------------------------------------------------------------- errors


def test_malformed_json_is_a_400(server: Harness) -> None:
    response = server.client.post(
        "/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


def test_validation_error_is_a_400_naming_the_field(server: Harness) -> None:
    error = assert_error(server.post("/v1/completions", {"prompt": "a", "temperature": 5}), 400)
    assert error["param"] == "temperature"
    error = assert_error(server.post("/v1/completions", {"prompt": "a", "nts_tmax": 2}), 400)
    assert error["param"] == "nts_tmax"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"nts_rule": "hot"}, "not a rule"),
        ({"nts_t_min": 2.0}, "t_min"),
        ({"vllm_xargs": {"nts_bogus": 1}}, "Unknown noisy-temp-server request key"),
        ({"vllm_xargs": {"nts_trace_id": "mine"}}, "set by the server"),
        ({"vllm_xargs": {"nts_capture": True}}, "set by the server"),
        ({"nts_t": 1.5}, "nts_t only applies to the fixed rule"),
        ({"vllm_xargs": {"nts_runtime_noise_sigma": 1.0}}, "runtime noise is a server setting"),
        ({"nts_runtime_noise_sigma": 1.0}, "runtime noise is a server setting"),
    ],
)
def test_bad_nts_keys_are_400s(server: Harness, keys: dict[str, Any], message: str) -> None:
    error = assert_error(server.post("/v1/completions", {"prompt": "a", **keys}), 400)
    assert message in error["message"]
    assert server.engine.calls == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {"--5": 1}}, "token ids"),
        ({"logit_bias": {"\u00b2": 1}}, "token ids"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63 - 2, "n": 3}, "seed"),
    ],
)
def test_out_of_range_sampling_fields_are_400s(
    server: Harness, fields: dict[str, Any], message: str
) -> None:
    error = assert_error(server.post("/v1/completions", {"prompt": "a", **fields}), 400)
    assert message in error["message"]
    assert server.engine.calls == []


def test_the_largest_seed_of_n_choices_is_accepted(server: Harness) -> None:
    body = {"prompt": "a", "max_tokens": 1, "n": 3, "seed": 2**63 - 3, "logit_bias": {"-0": 1}}
    assert server.post("/v1/completions", body).status_code == 200
    assert max(params.seed or 0 for _, params, _ in server.engine.calls) == 2**63 - 1


def test_unknown_model_is_a_404(server: Harness) -> None:
    error = assert_error(
        server.post("/v1/completions", {"model": "gpt-5", "prompt": "a"}), 404, "model_not_found"
    )
    assert error["param"] == "model"


def test_over_context_length_is_a_400(server: Harness) -> None:
    assert_error(
        server.post("/v1/completions", {"prompt": "a" * 60, "max_tokens": 10}),
        400,
        "context_length_exceeded",
    )
    assert_error(
        server.post("/v1/completions", {"prompt": "a" * MAX_MODEL_LEN, "max_tokens": None}),
        400,
        "context_length_exceeded",
    )


def test_engine_validation_error_is_a_400_streaming_or_not(server: Harness) -> None:
    body = {"prompt": [5, VOCAB + 1], "max_tokens": 2}
    assert_error(server.post("/v1/completions", body), 400)
    assert_error(server.post("/v1/completions", {**body, "stream": True}), 400)


def test_unknown_route_is_an_openai_404(server: Harness) -> None:
    assert_error(server.client.get("/v1/nothing"), 404)


def test_bad_requests_do_not_disturb_the_next_ones(server: Harness) -> None:
    good = {"prompt": "abc", "max_tokens": 2}
    assert server.post("/v1/completions", good).status_code == 200
    assert server.post("/v1/completions", {"prompt": "a", "n": 0}).status_code == 400
    response = server.client.post(
        "/v1/completions", content=b"nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert server.post("/v1/completions", {**good, "stream": True}).status_code == 200
    assert server.post("/v1/completions", good).json()["choices"][0]["text"] == " t3 t4"


def test_api_key_is_required_when_configured() -> None:
    harness = build(Settings(api_key="sekrit"), POLICY)  # type: ignore[arg-type]
    body = {"prompt": "abc", "max_tokens": 1}
    assert_error(harness.post("/v1/completions", body), 401, "invalid_api_key")
    assert_error(
        harness.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}),
        401,
        "invalid_api_key",
    )
    ok = harness.post("/v1/completions", body, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert harness.client.get("/health").status_code == 200
    assert harness.client.get("/metrics").status_code == 200


# ----------------------------------------------------------------------------- other routes


def test_models_health_and_status(server: Harness) -> None:
    models = server.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert server.client.get("/health").status_code == 200
    status = server.client.get("/v1/nts/status").json()
    assert status["policy_version"] == 7
    assert status["policy"]["rule"] == "sqrt"
    assert status["alpha_by_step_bucket"] == {"0+": 0.5625}
    assert status["bias"] is None
    assert status["estimator"] == {"enabled": False, "origin": "test"}
    assert status["shadow"] == {"enabled": False}
    server.engine.dead = True
    assert server.client.get("/health").status_code == 503


def test_a_streamed_request_is_timed_to_the_end_of_its_body(server: Harness) -> None:
    server.engine.step_seconds = 0.05
    body = {"prompt": "abc", "max_tokens": 4, "stream": True}
    assert server.post("/v1/completions", body).status_code == 200
    route = "/v1/completions"
    assert server.metric("nts_http_request_duration_seconds_count", route=route) == 1
    seconds = server.metric("nts_http_request_duration_seconds_sum", route=route)
    assert seconds is not None
    assert seconds >= 4 * 0.05  # every step, not only the first


def test_server_defaults_apply_unless_the_request_overrides_them() -> None:
    harness = build(Settings(default_rule="fixed", default_t=1.5), POLICY, trace_t=1.5)
    body = {"prompt": "abc", "max_tokens": 1}
    assert harness.post("/v1/completions", body).json()["nts"]["rule"] == "fixed"
    assert (
        harness.post("/v1/completions", {**body, "nts_rule": "linear"}).json()["nts"]["rule"]
        == "linear"
    )


def test_a_server_default_t_without_its_fixed_rule_leaves_other_rules_alone() -> None:
    harness = build(Settings(default_t=1.5), POLICY)  # POLICY's rule is sqrt
    response = harness.post("/v1/completions", {"prompt": "abc", "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["nts"]["rule"] == "sqrt"


def test_metrics_count_requests_and_temperatures(server: Harness) -> None:
    server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2})
    server.post("/v1/completions", {"prompt": "a", "n": 0})
    server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream": True})
    text = server.client.get("/metrics").text
    assert "nts_http_requests_total" in text
    route = "/v1/completions"
    assert server.metric("nts_http_requests_total", method="POST", route=route, status="200") == 2
    assert server.metric("nts_http_requests_total", method="POST", route=route, status="400") == 1
    assert server.metric("nts_http_request_duration_seconds_count", route=route) == 3
    assert server.metric("nts_request_temperature_mean_count", rule="sqrt") == 2
    assert server.metric("nts_request_temperature_mean_sum", rule="sqrt") == 2.5


def test_a_client_chosen_method_is_counted_as_other(server: Harness) -> None:
    for method in ("BREW", "PROPFIND", "BREW"):
        response = server.client.request(method, "/v1/completions")
        assert response.status_code == 405
        assert response.json()["error"]["message"]
    labels = {"route": "unmatched", "status": "405"}  # a route matches its methods too
    assert server.metric("nts_http_requests_total", method="other", **labels) == 3
    assert server.metric("nts_http_requests_total", method="BREW", **labels) is None


class BarrierTraces(FakeTraces):
    """A trace channel whose waits only return once `parties` of them are waiting at once."""

    def __init__(self, temperature: float, parties: int) -> None:
        super().__init__(temperature)
        self.barrier = asyncio.Barrier(parties)

    async def wait_for(
        self, trace_id: str, n_steps: int, timeout: float, *, want_trace: bool = False
    ) -> TraceReport:
        # TimeoutError (-> a 500) if the waits run one after another.
        await asyncio.wait_for(self.barrier.wait(), 5)
        return await super().wait_for(trace_id, n_steps, timeout, want_trace=want_trace)


def test_the_choices_wait_for_their_traces_together() -> None:
    server = build(Settings(), POLICY, traces=BarrierTraces(1.25, parties=3))
    response = server.post("/v1/completions", {"prompt": "ab", "max_tokens": 2, "n": 3})
    assert response.status_code == 200, response.text
    assert [c["nts"]["t_mean"] for c in response.json()["choices"]] == [1.25] * 3


def test_temperatures_are_reported_at_float32_precision() -> None:
    float32_t = 1.2000000476837158  # what the engine's float32 T* of 1.2 reads as in Python
    server = build(Settings(), POLICY, trace_t=float32_t)
    body = {"prompt": "ab", "max_tokens": 2, "nts_trace": True}
    nts = server.post("/v1/completions", body).json()["nts"]
    assert (nts["t_mean"], nts["t_min"], nts["t_max"], nts["trace"]) == (1.2, 1.2, 1.2, [1.2, 1.2])
