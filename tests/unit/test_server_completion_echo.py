"""`echo` and prompt logprobs on `/v1/completions`, with the fake engine (server_fakes): the
shapes vLLM's own server answers with, and what lm-evaluation-harness's log-likelihood requests
read from them.

The fake engine gives the prompt tokens (after the first, which has none) logprob -1 with their
successor at -2, and each generated token (id = its position) -0.5; the fake tokenizer maps a
character to its code point.
"""

from __future__ import annotations

from typing import Any

import pytest
from lm_eval.models.openai_completions import LocalCompletionsAPI
from server_fakes import POLICY, Harness, assert_error, build, sse_events

from noisy_temp_server.settings import Settings


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


def test_echo_puts_the_prompt_before_the_completion(server: Harness) -> None:
    response = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "echo": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "abc t3 t4"
    assert choice["logprobs"] is None
    assert server.engine.calls[0][1].prompt_logprobs is None
    assert response.json()["usage"]["completion_tokens"] == 2


def test_echo_with_logprobs_gives_the_prompt_tokens_theirs(server: Harness) -> None:
    response = server.post(
        "/v1/completions", {"prompt": "abc", "max_tokens": 1, "echo": True, "logprobs": 1}
    )
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c", " t3"]
    assert logprobs["token_logprobs"] == [None, -1.0, -1.0, -0.5]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"b": -1.0, "c": -2.0}
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    assert server.engine.calls[0][1].prompt_logprobs == 1


def test_echo_without_generation_returns_the_prompt_alone(server: Harness) -> None:
    response = server.post(
        "/v1/completions", {"prompt": "abcd", "max_tokens": 0, "echo": True, "logprobs": 0}
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "abcd"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c", "d"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -1.0]
    assert server.engine.calls[0][1].max_tokens == 1  # the engine generates one, left out


def test_a_one_prompt_batch_of_token_ids_is_echoed_as_text(server: Harness) -> None:
    response = server.post(
        "/v1/completions", {"prompt": [[104, 105]], "max_tokens": 1, "echo": True}
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "hi t2"
    assert server.engine.calls[0][0] == [104, 105]


def _streamed_choices(server: Harness, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = server.post("/v1/completions", {"prompt": "abc", "stream": True, **body})
    assert response.status_code == 200, response.text
    return [c for e in sse_events(response) if e != "[DONE]" for c in e["choices"]]


def test_a_streamed_echo_starts_each_choice_with_the_prompt_and_its_ids(server: Harness) -> None:
    """As vLLM's: the prompt's text and ids (whether or not `return_token_ids` asks) in each
    choice's first chunk, with the first generated token; no prompt logprobs key in a chunk."""
    choices = _streamed_choices(server, {"max_tokens": 2, "echo": True, "n": 2, "seed": 1})
    firsts = [c for c in choices if "prompt_token_ids" in c]
    # The two choices stream concurrently: their chunks may interleave in either order.
    assert sorted((c["index"], c["text"]) for c in firsts) == [(0, "abc t3"), (1, "abc t3")]
    assert all(c["prompt_token_ids"] == [97, 98, 99] for c in firsts)
    assert sorted(c["text"] for c in choices if c not in firsts) == [" t4", " t4"]
    assert not any("prompt_logprobs" in c for c in choices)


def test_a_streamed_echo_with_logprobs_gives_the_prompt_tokens_theirs(server: Harness) -> None:
    first, second = _streamed_choices(server, {"max_tokens": 2, "echo": True, "logprobs": 1})
    assert first["logprobs"]["tokens"] == ["a", "b", "c", " t3"]
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -0.5]
    assert first["logprobs"]["top_logprobs"][:2] == [None, {"b": -1.0, "c": -2.0}]
    assert first["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert second["logprobs"]["tokens"] == [" t4"]
    assert second["logprobs"]["text_offset"] == [6]  # after the echoed prompt's tokens
    assert server.engine.calls[0][1].prompt_logprobs == 1


def test_a_streamed_echo_without_generation_is_the_prompt_alone(server: Harness) -> None:
    (only,) = _streamed_choices(server, {"max_tokens": 0, "echo": True, "logprobs": 0})
    assert only["text"] == "abc"
    assert only["logprobs"]["tokens"] == ["a", "b", "c"]
    assert only["finish_reason"] == "length"


def test_a_streamed_echo_with_return_token_ids_echoes_the_ids_alone(server: Harness) -> None:
    body = {"max_tokens": 1, "echo": True, "return_token_ids": True}
    (only,) = _streamed_choices(server, body)
    assert (only["text"], only["token_ids"], only["prompt_token_ids"]) == (" t3", [3], [97, 98, 99])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 0}, "0 only with echo"),
        ({"prompt": [[]]}, "must not be empty"),
    ],
)
def test_refused_echo_forms(server: Harness, body: dict[str, object], message: str) -> None:
    response = server.post("/v1/completions", {"prompt": "abc", **body})
    assert_error(response, 400)
    assert message in response.json()["error"]["message"]


def test_lm_eval_reads_a_log_likelihood_from_the_echoed_logprobs(server: Harness) -> None:
    """lm-evaluation-harness's `local-completions` log-likelihood request: echo, logprobs 1,
    max_tokens 1, the context and continuation as one token-id prompt; it sums the continuation
    positions' logprobs (all but the generated last one) and checks each is the top one."""
    context, continuation = [104, 105], [106, 107]
    body = server.post(
        "/v1/completions",
        {
            "prompt": [context + continuation],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    ).json()
    ((logprob, greedy),) = LocalCompletionsAPI.parse_logprobs(body, ctxlens=[len(context)])
    assert logprob == pytest.approx(-2.0)
    assert greedy
