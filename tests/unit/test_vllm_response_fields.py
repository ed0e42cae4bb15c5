"""vLLM's fields that shape what a response reports (`return_token_ids`, `return_prompt_text`,
`return_tokens_as_token_ids`, `logprob_token_ids`), answered as vLLM's server answers them
(with the fake engine of server_fakes: a character is its code point, generated token ids are
positions). tests/e2e/test_openai_parity.py sends them to both real servers."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import POLICY, Harness, assert_error, build, sse_events
from vllm.logprobs import Logprob

from noisy_temp_server.server.chat import chat_logprobs
from noisy_temp_server.server.response_bodies import LogprobTokens
from noisy_temp_server.settings import Settings

_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_COMPLETION = {"prompt": "abc", "max_tokens": 2}
_RENDERED = "<user>hi<assistant>"  # the fake tokenizer's chat template
_ABC = [97, 98, 99]


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


def test_chat_return_token_ids_and_prompt_text(server: Harness) -> None:
    body = {**_CHAT, "return_token_ids": True, "return_prompt_text": True, "n": 2, "seed": 1}
    answer = server.post("/v1/chat/completions", body).json()
    prompt = [ord(c) for c in _RENDERED]
    assert answer["prompt_token_ids"] == prompt
    assert answer["prompt_text"] == _RENDERED
    assert [c["token_ids"] for c in answer["choices"]] == [[19, 20], [19, 20]]
    plain = server.post("/v1/chat/completions", _CHAT).json()
    assert not {"prompt_token_ids", "prompt_text"} & set(plain)
    assert "token_ids" not in plain["choices"][0]


def test_chat_stream_reports_the_prompt_on_its_opening_chunks(server: Harness) -> None:
    body = {**_CHAT, "return_token_ids": True, "return_prompt_text": True, "stream": True}
    chunks = [c for c in sse_events(server.post("/v1/chat/completions", body)) if c != "[DONE]"]
    opening, *steps = chunks
    assert opening["prompt_token_ids"] == [ord(c) for c in _RENDERED]
    assert opening["prompt_text"] == _RENDERED
    assert all("prompt_text" not in chunk for chunk in steps)
    step_ids = [c["choices"][0]["token_ids"] for c in steps if c["choices"]]
    assert step_ids == [[19], [20]]


def test_completion_return_token_ids(server: Harness) -> None:
    body = {**_COMPLETION, "return_token_ids": True, "prompt": ["abc", "de"]}
    choices = server.post("/v1/completions", body).json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [_ABC, [100, 101]]
    assert [c["token_ids"] for c in choices] == [[3, 4], [2, 3]]
    plain = server.post("/v1/completions", _COMPLETION).json()["choices"][0]
    assert not {"prompt_token_ids", "token_ids"} & set(plain)


def test_completion_stream_reports_the_prompt_on_each_choices_first_chunk(
    server: Harness,
) -> None:
    body = {**_COMPLETION, "return_token_ids": True, "stream": True, "n": 2, "seed": 1}
    events = [c for c in sse_events(server.post("/v1/completions", body)) if c != "[DONE]"]
    choices = [c["choices"][0] for c in events if c["choices"]]
    for index in (0, 1):
        own = [c for c in choices if c["index"] == index]
        assert own[0]["prompt_token_ids"] == _ABC
        assert all("prompt_token_ids" not in c for c in own[1:])
        assert [c["token_ids"] for c in own] == [[3], [4]]


def test_echo_with_return_token_ids_echoes_ids_not_text_as_vllm(server: Harness) -> None:
    body = {**_COMPLETION, "echo": True, "return_token_ids": True}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    assert choice["text"] == " t3 t4"
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (_ABC, [3, 4])
    echoed = server.post("/v1/completions", {**_COMPLETION, "echo": True}).json()
    assert echoed["choices"][0]["text"] == "abc t3 t4"


def _chat_logprobs(server: Harness, **fields: Any) -> list[dict[str, Any]]:
    body = {**_CHAT, "logprobs": True, **fields}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["logprobs"]["content"])


def _completion_logprobs(server: Harness, **fields: Any) -> dict[str, Any]:
    response = server.post("/v1/completions", {**_COMPLETION, "logprobs": 1, **fields})
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0]["logprobs"])


def test_return_tokens_as_token_ids_names_each_token_by_its_id(server: Harness) -> None:
    first = _chat_logprobs(server, top_logprobs=2, return_tokens_as_token_ids=True)[0]
    assert first["token"] == "token_id:19"
    assert first["bytes"] == list(b"token_id:19")
    assert [t["token"] for t in first["top_logprobs"]] == ["token_id:19", "token_id:20"]
    legacy = _completion_logprobs(server, return_tokens_as_token_ids=True)
    assert legacy["tokens"] == ["token_id:3", "token_id:4"]
    assert set(legacy["top_logprobs"][0]) == {"token_id:3", "token_id:4"}
    assert legacy["text_offset"] == [0, len("token_id:3")]  # vLLM's offsets: by the names
    assert _chat_logprobs(server, top_logprobs=1)[0]["token"] == " t19"


@pytest.mark.parametrize(
    ("sampled", "listed"),
    [(2, [" b", " a"]), (9, [" s", " a"]), (1, [" a", " b"])],
)
def test_chat_top_logprobs_come_in_the_engines_order_as_vllms(
    sampled: int, listed: list[str]
) -> None:
    """vLLM's engine gives a position's candidates the sampled token first, then the best by
    rank (the sampled one once); vLLM's chat lists the first `top_logprobs` of them as they
    come: a sampled token outside the top ones displaces the last of them."""
    ranked = {1: Logprob(-0.5, 1, " a"), 2: Logprob(-1.0, 2, " b"), 3: Logprob(-2.0, 3, " c")}
    sampled_entry = ranked.get(sampled, Logprob(-3.0, 7, " s"))
    position = {sampled: sampled_entry} | ranked
    (entry,) = chat_logprobs([sampled], [position], LogprobTokens(top=2)).content
    assert [t.token for t in entry.top_logprobs] == listed
    assert entry.logprob == sampled_entry.logprob


def test_logprob_token_ids_lists_the_ids_asked_for(server: Harness) -> None:
    first = _chat_logprobs(server, logprob_token_ids=[7, 9])[0]
    params = server.engine.calls[-1][1]
    assert (params.logprobs, params.logprob_token_ids) == (None, [7, 9])
    assert [t["token"] for t in first["top_logprobs"]] == [" t19", " t7", " t9"]
    legacy = _completion_logprobs(server, logprob_token_ids=[7])
    assert server.engine.calls[-1][1].logprob_token_ids == [7]
    assert legacy["top_logprobs"][0] == {" t3": -0.5, " t7": -3.0}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**_CHAT, "logprob_token_ids": [7]}),
        ("/v1/completions", {**_COMPLETION, "logprob_token_ids": [7]}),
        (
            "/v1/completions",
            {**_COMPLETION, "logprob_token_ids": [7], "logprobs": 1, "echo": True, "max_tokens": 0},
        ),
    ],
)
def test_logprob_token_ids_refused_where_vllm_refuses_them(
    server: Harness, path: str, body: dict[str, Any]
) -> None:
    assert "logprob_token_ids" in assert_error(server.post(path, body), 400)["message"]
    assert server.engine.calls == []
