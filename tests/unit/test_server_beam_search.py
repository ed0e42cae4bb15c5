"""`use_beam_search` (`server.beam_search`): vLLM's own beam search over the engine, its steps
greedy one-token requests with the request's `nts_*` keys, its `n` best beams the choices, T*
reported as not applied (with the fake engine of server_fakes: generated token ids are
positions, each step's candidates the position and the next id)."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import POLICY, Harness, assert_error, build

from noisy_temp_server.engine_contract.keys import KEY_POLICY
from noisy_temp_server.settings import Settings

_COMPLETION = {"prompt": "abc", "max_tokens": 3, "use_beam_search": True, "n": 2}
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "use_beam_search": True}


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


def test_beam_search_steps_are_greedy_one_token_requests_with_the_nts_keys(
    server: Harness,
) -> None:
    response = server.post("/v1/completions", {**_COMPLETION, "temperature": 0.9})
    assert response.status_code == 200, response.text
    steps = [params for _, params, _ in server.engine.calls]
    assert len(steps) > 3  # one per beam per generated token
    assert all((p.max_tokens, p.temperature, p.logprobs) == (1, 0.0, 4) for p in steps)
    extra_args = steps[0].extra_args or {}
    assert KEY_POLICY in extra_args
    assert all(key.startswith("nts_") for key in extra_args)
    assert server.traces.waited == []  # untuned: no T* trace to wait for


def test_beam_search_answers_n_choices_each_with_t_star_not_applied(server: Harness) -> None:
    answer = server.post("/v1/completions", {**_COMPLETION, "prompt": ["abc", "de"]}).json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == "".join(chr(t) for t in (3, 4, 5))  # the best beam
    assert choices[1]["text"] != choices[0]["text"]
    assert all(c["nts"]["rule"] == "off" and c["nts"]["t_mean"] == 1.0 for c in choices)
    assert choices[0]["logprobs"] is None
    assert answer["usage"]["completion_tokens"] == 12


def test_beam_search_returns_logprobs_only_when_asked(server: Harness) -> None:
    asked = server.post("/v1/completions", {**_COMPLETION, "logprobs": 1}).json()
    assert len(asked["choices"][0]["logprobs"]["tokens"]) == 3
    chat = server.post("/v1/chat/completions", {**_CHAT, "logprobs": True}).json()
    assert len(chat["choices"][0]["logprobs"]["content"]) == 2
    assert server.post("/v1/chat/completions", _CHAT).json()["choices"][0]["logprobs"] is None


def test_a_chat_beam_search_streams(server: Harness) -> None:
    response = server.post("/v1/chat/completions", {**_CHAT, "stream": True})
    assert response.status_code == 200, response.text
    assert "data: [DONE]" in response.text


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {**_COMPLETION, "stream": True}),
        ("/v1/completions", {**_COMPLETION, "echo": True, "logprobs": 1}),
        ("/v1/chat/completions", {**_CHAT, "logprobs": True, "logprob_token_ids": [5]}),
    ],
)
def test_beam_search_refused_where_vllm_refuses_it(
    server: Harness, path: str, fields: dict[str, Any]
) -> None:
    assert_error(server.post(path, fields), 400)
    assert server.engine.calls == []


def test_use_beam_search_false_is_sampling(server: Harness) -> None:
    body = {**_COMPLETION, "use_beam_search": False, "seed": 1}
    assert server.post("/v1/completions", body).status_code == 200
    assert [p.temperature for _, p, _ in server.engine.calls] == [1.0, 1.0]


def test_a_length_penalty_that_overflows_the_scores_is_a_400(server: Harness) -> None:
    body = {**_COMPLETION, "length_penalty": 1e308}
    assert assert_error(server.post("/v1/completions", body), 400)["param"] == "length_penalty"
