"""What vLLM's OpenAI server answers, with the fake engine (server_fakes): a list of prompts on
`/v1/completions`, `min_tokens`, structured outputs (`response_format`, `structured_outputs`),
`/tokenize`, `/detokenize` and `/version`. tests/e2e/test_openai_parity.py compares the real
servers side by side.

The fake tokenizer maps a character to its code point; the fake engine's token ids are their
positions."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import MAX_MODEL_LEN, MODEL, POLICY, Harness, assert_error, build, sse_events
from vllm import __version__ as vllm_version

from noisy_temp_server.engine_contract.request_args import capturable
from noisy_temp_server.server.serving import MAX_CHOICES
from noisy_temp_server.settings import Settings


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


def test_a_list_of_prompts_gets_n_choices_each_in_vllms_order(server: Harness) -> None:
    response = server.post(
        "/v1/completions", {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 1, "seed": 5}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [" t2", " t2", " t3", " t3"]
    assert all(c["nts"]["steps"] == 1 for c in body["choices"])
    assert body["nts"]["steps"] == 4
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    prompts = [call[0] for call in server.engine.calls]
    assert sorted(prompts) == [[97, 98], [97, 98], [99, 100, 101], [99, 100, 101]]
    assert sorted(call[1].seed for call in server.engine.calls) == [5, 5, 6, 6]


def test_a_list_of_token_id_prompts_is_echoed_prompt_by_prompt(server: Harness) -> None:
    response = server.post(
        "/v1/completions", {"prompt": [[104, 105], [106]], "max_tokens": 1, "echo": True}
    )
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == ["hi t2", "j t1"]


def test_a_list_of_prompts_streams_every_choice(server: Harness) -> None:
    response = server.post(
        "/v1/completions", {"prompt": ["a", "bc"], "max_tokens": 2, "stream": True}
    )
    assert response.status_code == 200, response.text
    events = [e for e in sse_events(response) if e != "[DONE]"]
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1}
    assert events[-1]["nts"]["steps"] == 4


def test_a_prompt_of_the_list_over_the_context_is_a_400(server: Harness) -> None:
    response = server.post("/v1/completions", {"prompt": ["a", "b" * MAX_MODEL_LEN]})
    assert_error(response, 400, "context_length_exceeded")
    assert server.engine.calls == []


_CONTINUOUS = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def test_continuous_usage_stats_put_each_choices_usage_on_every_completion_chunk(
    server: Harness,
) -> None:
    """As vLLM's: each chunk has its choice's prompt (of a list: its own) and its tokens so
    far; the last chunk the whole request's."""
    response = server.post(
        "/v1/completions", {"prompt": ["a", "bc"], "max_tokens": 2, **_CONTINUOUS}
    )
    assert response.status_code == 200, response.text
    chunks = [e for e in sse_events(response) if e != "[DONE]"]
    generated = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        generated[choice["index"]] += 1
        assert chunk["usage"] == _usage(choice["index"] + 1, generated[choice["index"]])
    assert generated == {0: 2, 1: 2}
    assert chunks[-1]["usage"] == _usage(3, 4)


def test_continuous_usage_stats_on_chat_count_from_the_opening_chunk(server: Harness) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    response = server.post("/v1/chat/completions", {**body, "seed": 1, **_CONTINUOUS})
    assert response.status_code == 200, response.text
    chunks = [e for e in sse_events(response) if e != "[DONE]"]
    prompt = len("<user>hi<assistant>")
    assert [c["usage"] for c in chunks[:2]] == [_usage(prompt, 0)] * 2  # the roles
    counts = [c["usage"]["completion_tokens"] for c in chunks[2:-1]]
    assert sorted(counts) == [1, 1, 2, 2]
    assert chunks[-1]["usage"] == _usage(prompt, 4)


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(server: Harness) -> None:
    options = {"include_usage": True, "continuous_usage_stats": False}
    response = server.post(
        "/v1/completions",
        {"prompt": "a", "max_tokens": 2, "stream": True, "stream_options": options},
    )
    chunks = [e for e in sse_events(response) if e != "[DONE]"]
    assert ["usage" in c for c in chunks] == [False, False, True]


_CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_null_stream_options_mean_false_as_on_vllms_server(server: Harness) -> None:
    """vLLM's `StreamOptions` takes null for each option (false), and null or empty
    `stream_options` without `stream`; non-empty ones without `stream` stay its 400."""
    body = {"prompt": "a", "max_tokens": 2}
    nulls = {"include_usage": True, "continuous_usage_stats": None}
    response = server.post("/v1/completions", {**body, "stream": True, "stream_options": nulls})
    assert response.status_code == 200, response.text
    chunks = [e for e in sse_events(response) if e != "[DONE]"]
    assert ["usage" in c for c in chunks] == [False, False, True]
    no_usage = {"stream": True, "stream_options": {"include_usage": None}}
    chunks = [e for e in sse_events(server.post("/v1/completions", {**body, **no_usage}))]
    assert not any("usage" in c for c in chunks if c != "[DONE]")
    for options, stream in [(None, True), (None, False), ({}, False)]:
        fields = {"stream": stream, "stream_options": options}
        response = server.post("/v1/chat/completions", {**_CHAT_BODY, **fields})
        assert response.status_code == 200, (options, stream, response.text)
    refused = {"stream_options": {"include_usage": False}}
    assert_error(server.post("/v1/chat/completions", {**_CHAT_BODY, **refused}), 400)


def test_min_tokens_and_structured_outputs_reach_the_engine(server: Harness) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    response = server.post("/v1/chat/completions", {**body, "response_format": fmt})
    assert response.status_code == 200, response.text
    assert "nts" in response.json()
    params = server.engine.calls[-1][1]
    assert params.min_tokens == 2
    assert params.structured_outputs is not None
    assert params.structured_outputs.json == {"type": "integer"}
    assert not capturable(params)  # the grammar's rows are not the model's: never shadow-scored
    regex = {"structured_outputs": {"regex": "[ab]+"}}
    response = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, **regex})
    assert response.status_code == 200, response.text
    assert server.engine.calls[-1][1].structured_outputs.regex == "[ab]+"


@pytest.mark.parametrize(
    "fields",
    [
        {"min_tokens": 5, "max_tokens": 2},
        {"response_format": {"type": "json_schema"}},
        {"structured_outputs": {"choice": ["a"], "regex": "a"}},
    ],
)
def test_bad_constraints_are_openai_400s(server: Harness, fields: dict[str, Any]) -> None:
    assert_error(server.post("/v1/completions", {"prompt": "x", **fields}), 400)


def test_tokenize_and_detokenize(server: Harness) -> None:
    response = server.post("/tokenize", {"prompt": "hi", "return_token_strs": True})
    assert response.json() == {
        "count": 2,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": [104, 105],
        "token_strs": ["h", "i"],
    }
    chat = server.post(
        "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["count"] == len("<user>a<assistant>")
    assert server.post("/detokenize", {"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert_error(server.post("/detokenize", {"tokens": [-1]}), 400)
    assert_error(server.post("/tokenize", {"prompt": "hi", "model": "other"}), 404)
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert_error(server.post("/tokenize", {"messages": [{"role": "user", "content": image}]}), 400)


def test_version_is_vllms(server: Harness) -> None:
    assert server.client.get("/version").json() == {"version": vllm_version}


def test_tokenize_needs_no_api_key_as_in_vllm() -> None:
    from pydantic import SecretStr  # noqa: PLC0415

    guarded = build(Settings(api_key=SecretStr("k")), POLICY)
    assert guarded.post("/tokenize", {"prompt": "hi"}).status_code == 200
    assert_error(guarded.post("/v1/completions", {"prompt": "hi"}), 401)


def test_a_request_makes_at_most_max_choices_engine_requests(server: Harness) -> None:
    prompts = ["ab"] * (MAX_CHOICES // 4 + 1)
    response = server.post("/v1/completions", {"prompt": prompts, "n": 4, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert f"at most {MAX_CHOICES}" in response.json()["error"]["message"]
    assert server.engine.calls == []


def test_a_prompt_the_tokenizer_refuses_is_a_400_as_on_vllms_server() -> None:
    """A lone surrogate (valid JSON: "\\ud800") makes a Hugging Face fast tokenizer raise a
    TypeError; vLLM's server answers such raw errors of a request with a 400, and so does
    ours, before anything reaches the engine."""
    from tiny_model import build_tiny_tokenizer  # noqa: PLC0415

    server = build(Settings(), POLICY, tokenizer=build_tiny_tokenizer())
    body = '{"prompt": "a\\ud800"}'  # a JSON escape: the client would not encode the character
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/tokenize"):
        response = server.client.post(path, content=body, headers=headers)
        assert "TextEncodeInput" in assert_error(response, 400)["message"]
    assert server.engine.calls == []
    assert server.post("/v1/completions", {"prompt": "ab", "max_tokens": 1}).status_code == 200
