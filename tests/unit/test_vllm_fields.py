"""vLLM's own request fields (`server.vllm_fields`): every field of vLLM's two generation
requests is taken here or refused on purpose, and the ones taken mean what they mean for vLLM
(with the fake engine of server_fakes: a character is its code point, generated token ids are
positions). tests/e2e/test_openai_parity.py sends them to both real servers."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from server_fakes import MAX_MODEL_LEN, POLICY, Harness, assert_error, build, sse_events
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletionRequest

from noisy_temp_server.server.protocol import ChatCompletionRequest, CompletionRequest
from noisy_temp_server.server.vllm_fields import NOT_TAKEN
from noisy_temp_server.settings import Settings

_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_COMPLETION = {"prompt": "abc", "max_tokens": 2}


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [(VllmChatRequest, ChatCompletionRequest), (VllmCompletionRequest, CompletionRequest)],
)
def test_every_vllm_field_is_taken_or_refused_on_purpose(
    theirs: type[BaseModel], ours: type[BaseModel]
) -> None:
    unaccounted = set(theirs.model_fields) - set(ours.model_fields) - set(NOT_TAKEN)
    assert not unaccounted, f"vLLM fields neither taken nor in NOT_TAKEN: {sorted(unaccounted)}"
    assert not set(NOT_TAKEN) & set(ours.model_fields)


@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_a_refused_field_is_a_400_saying_why(server: Harness, name: str) -> None:
    error = assert_error(server.post("/v1/completions", {**_COMPLETION, name: None}), 400)
    assert (error["param"], NOT_TAKEN[name] in error["message"]) == (name, True)
    assert server.engine.calls == []


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", _COMPLETION), ("/v1/chat/completions", _CHAT)]
)
def test_unknown_fields_are_ignored_as_vllm_ignores_them(
    server: Harness, path: str, body: dict[str, Any]
) -> None:
    response = server.post(path, {**body, "metadata": {"a": 1}, "bogus": [1]})
    assert response.status_code == 200, response.text
    assert len(server.engine.calls) == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"nts_tmax": 2.0}, "nts_tmax"),  # a key of ours misspelt
        ({"vllm_xargs": {"nts_tmax": 2.0}}, None),
    ],
)
def test_a_misspelt_key_of_ours_and_unknown_nested_keys_are_400s(
    server: Harness, fields: dict[str, Any], param: str | None
) -> None:
    error = assert_error(server.post("/v1/completions", {**_COMPLETION, **fields}), 400)
    if param is not None:
        assert error["param"] == param
    assert server.engine.calls == []


def test_an_unknown_stream_options_key_is_ignored_as_vllm_ignores_it(server: Harness) -> None:
    body = {**_COMPLETION, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(server.engine.calls) == 1


def test_sampling_fields_reach_the_engine_as_vllm_passes_them(server: Harness) -> None:
    fields: dict[str, Any] = {
        "top_k": 5,
        "min_p": 0.1,
        "stop_token_ids": [7],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "allowed_token_ids": [1, 2, 3],
        "bad_words": ["zz"],
        "stream_interval": 2,
        "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
        "kv_transfer_params": {"a": 1},
    }
    for path, body in (("/v1/chat/completions", _CHAT), ("/v1/completions", _COMPLETION)):
        response = server.post(path, {**body, **fields})
        assert response.status_code == 200, response.text
        params = server.engine.calls[-1][1]
        assert (params.top_k, params.min_p, params.stop_token_ids) == (5, 0.1, [7])
        assert params.include_stop_str_in_output
        assert not params.skip_special_tokens
        assert not params.spaces_between_special_tokens
        assert params.allowed_token_ids == [1, 2, 3]
        assert params.bad_words == ["zz"]
        assert params.stream_interval == 2
        assert params.repetition_detection is not None
        assert params.repetition_detection.min_count == 3
        assert params.extra_args is not None
        assert params.extra_args["kv_transfer_params"] == {"a": 1}


def test_unset_fields_keep_vllms_defaults(server: Harness) -> None:
    assert server.post("/v1/completions", _COMPLETION).status_code == 200
    params = server.engine.calls[-1][1]
    assert (params.top_k, params.min_p, params.stop_token_ids, params.bad_words) == (0, 0.0, [], [])
    assert params.skip_special_tokens
    assert params.spaces_between_special_tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", -2), ("min_p", 1.5), ("truncate_prompt_tokens", -2), ("cache_salt", "a/b")],
)
def test_values_vllm_refuses_are_400s(server: Harness, field: str, value: Any) -> None:
    assert_error(server.post("/v1/completions", {**_COMPLETION, field: value}), 400)
    assert server.engine.calls == []


@pytest.mark.parametrize(("side", "kept"), [("left", [100, 101, 102]), ("right", [97, 98, 99])])
def test_truncate_prompt_tokens_keeps_the_side_asked(
    server: Harness, side: str, kept: list[int]
) -> None:
    body = {"prompt": "abcdef", "max_tokens": 1, "truncate_prompt_tokens": 3}
    response = server.post("/v1/completions", {**body, "truncation_side": side})
    assert response.status_code == 200, response.text
    assert server.engine.calls[-1][0] == kept
    assert response.json()["usage"]["prompt_tokens"] == 3


def test_truncation_past_the_context_is_vllms_400(server: Harness) -> None:
    body = {**_COMPLETION, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}
    error = assert_error(server.post("/v1/completions", body), 400)
    assert "truncate_prompt_tokens" in error["message"]


def test_request_id_priority_and_cache_salt(server: Harness) -> None:
    body = {**_COMPLETION, "request_id": "mine", "priority": 3, "cache_salt": "salt", "n": 2}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "cmpl-mine"
    engine_ids = [call[2] for call in server.engine.calls]
    assert len(set(engine_ids)) == 2
    assert "mine" not in "".join(engine_ids)
    assert server.engine.priorities == [3, 3]
    assert all(p.get("cache_salt") == "salt" for p in server.engine.prompts)


@pytest.mark.parametrize(
    ("path", "body", "prefix"),
    [("/v1/completions", _COMPLETION, "cmpl"), ("/v1/chat/completions", _CHAT, "chatcmpl")],
)
def test_an_x_request_id_header_names_the_response_as_on_vllms_server(
    server: Harness, path: str, body: dict[str, Any], prefix: str
) -> None:
    """vLLM's `_base_request_id`: the header wins over the body's `request_id`; the engine
    requests keep ids of ours, unique though two requests send the same header."""
    header = {"X-Request-Id": "from-header"}
    sent = {**body, "request_id": "from-body"}
    answers = [
        server.post(path, sent, headers=header),
        server.post(path, {**sent, "stream": True}, headers=header),
    ]
    assert answers[0].json()["id"] == f"{prefix}-from-header"
    assert "nts" in answers[0].json()
    chunks = [c for c in sse_events(answers[1]) if c != "[DONE]"]
    assert {c["id"] for c in chunks} == {f"{prefix}-from-header"}
    assert "nts" in chunks[-1]
    engine_ids = [call[2] for call in server.engine.calls]
    assert len(set(engine_ids)) == 2
    assert not any("from-" in engine_id for engine_id in engine_ids)
    assert server.post(path, sent).json()["id"] == f"{prefix}-from-body"


def test_chat_template_arguments_render_as_vllm_renders_them(server: Harness) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    body = {"messages": messages, "max_tokens": 1, "add_generation_prompt": False}
    assert server.post("/v1/chat/completions", body).status_code == 200
    assert bytes(server.engine.calls[-1][0]).decode() == "<user>hi<assistant>ok"
    body = {**body, "continue_final_message": True, "chat_template_kwargs": {"unused": 1}}
    assert server.post("/v1/chat/completions", body).status_code == 200
    both = {**body, "add_generation_prompt": True}
    assert_error(server.post("/v1/chat/completions", both), 400)


def test_a_chat_template_in_the_request_is_refused_as_vllm_refuses_it(server: Harness) -> None:
    for extra in ({"chat_template": "{{ x }}"}, {"chat_template_kwargs": {"chat_template": "x"}}):
        error = assert_error(server.post("/v1/chat/completions", {**_CHAT, **extra}), 400)
        assert "--trust-request-chat-template" in error["message"]


def test_chat_echo_starts_the_answer_with_the_last_message_of_its_role(server: Harness) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    body = {"messages": messages, "max_tokens": 1, "echo": True}
    answer = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert answer.startswith("ok ")
    user_last = server.post("/v1/chat/completions", {**_CHAT, "echo": True}).json()
    assert not user_last["choices"][0]["message"]["content"].startswith("hi")


def test_add_special_tokens_defaults_differ_by_endpoint_as_in_vllm() -> None:
    assert CompletionRequest(prompt="x").add_special_tokens
    assert not ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).add_special_tokens


def test_prompt_logprobs_come_back_where_vllm_puts_them(server: Harness) -> None:
    chat = server.post("/v1/chat/completions", {**_CHAT, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None
    first = chat["prompt_logprobs"][1]
    assert all(set(c) == {"logprob", "rank", "decoded_token"} for c in first.values())
    assert server.engine.calls[-1][1].prompt_logprobs == 1
    completion = server.post("/v1/completions", {**_COMPLETION, "prompt_logprobs": 2}).json()
    assert len(completion["choices"][0]["prompt_logprobs"]) == 3  # "abc": one per prompt token
    plain = server.post("/v1/completions", _COMPLETION).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    assert "prompt_logprobs" not in server.post("/v1/chat/completions", _CHAT).json()


@pytest.mark.parametrize(("value", "stream"), [(1, True), (-2, False)])
def test_prompt_logprobs_vllm_refuses_are_400s(server: Harness, value: int, stream: bool) -> None:
    body = {**_COMPLETION, "prompt_logprobs": value, "stream": stream}
    assert "prompt_logprobs" in assert_error(server.post("/v1/completions", body), 400)["message"]
