"""Strict where OpenAI is strict: what OpenAI refuses is a 400 with a clear message, never
coerced or silently accepted, and nothing reaches the engine."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from server_fakes import (
    POLICY,
    Harness,
    assert_error,
    build,
)

from noisy_temp_server.server.protocol import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    CompletionRequest,
)
from noisy_temp_server.settings import Settings

USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY)


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, "1"])
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": USER_HI})],
)
def test_a_stream_flag_that_is_not_a_boolean_is_a_400(
    server: Harness, path: str, body: dict[str, Any], value: object
) -> None:
    error = assert_error(server.post(path, {**body, "stream": value}), 400)
    assert error["param"] == "stream"
    assert "valid boolean" in error["message"]
    assert server.engine.calls == []


@pytest.mark.parametrize(
    "fields",
    [
        {"echo": "no"},
        {"ignore_eos": 1},
        {"stream": True, "stream_options": {"include_usage": "yes"}},
    ],
)
def test_other_openai_booleans_are_strict_too(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="valid boolean"):
        CompletionRequest.model_validate({"prompt": "a", **fields})
    with pytest.raises(ValidationError, match="valid boolean"):
        ChatCompletionRequest.model_validate({"messages": USER_HI, "logprobs": "true"})


def test_more_than_four_stop_sequences_is_a_400(server: Harness) -> None:
    many = [f"s{i}" for i in range(1000)]
    for path, body in [
        ("/v1/completions", {"prompt": "a"}),
        ("/v1/chat/completions", {"messages": USER_HI}),
    ]:
        error = assert_error(server.post(path, {**body, "stop": many}), 400)
        assert error["param"] == "stop"
        assert f"stop takes up to {MAX_STOP_SEQUENCES} sequences" in error["message"]
    assert server.engine.calls == []


def test_four_stop_sequences_and_a_single_string_are_accepted(server: Harness) -> None:
    four = [f"s{i}" for i in range(MAX_STOP_SEQUENCES)]
    assert CompletionRequest.model_validate({"prompt": "a", "stop": four}).stop == four
    assert CompletionRequest.model_validate({"prompt": "a", "stop": "x"}).stop == "x"
    assert server.post("/v1/completions", {"prompt": "a", "stop": four}).status_code == 200


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_null_content_is_a_400_unless_the_message_is_the_assistants(
    server: Harness, role: str
) -> None:
    messages = [{"role": role, "content": None}]
    error = assert_error(server.post("/v1/chat/completions", {"messages": messages}), 400)
    assert error["param"] == "messages.0"
    assert f"content of a {role} message must be a string" in error["message"]
    assert server.engine.calls == []


def test_an_assistant_message_may_have_null_content(server: Harness) -> None:
    messages = [*USER_HI, {"role": "assistant", "content": None}, *USER_HI]
    assert server.post("/v1/chat/completions", {"messages": messages}).status_code == 200
