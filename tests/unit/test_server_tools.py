"""Tool calling (`server.tools`) with vLLM's own `pythonic` parser and the fake engine of
server_fakes: vLLM's refusals without a parser, the tools rendered by the chat template, the
JSON constraint of `required` and named choices, and the parsing of a choice's text into
`tool_calls` as vLLM's serving does it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_fakes import POLICY, FakeTokenizer, Harness, assert_error, build
from vllm.parser.parser_manager import ParserManager

from noisy_temp_server.server.protocol import ChatCompletionRequest
from noisy_temp_server.server.tools import ChatOutputParsing
from noisy_temp_server.settings import Settings

_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [_TOOL]}
_NAMED = {"type": "function", "function": {"name": "weather"}}


def _pythonic() -> Any:
    return ParserManager.get_parser(tool_parser_name="pythonic", enable_auto_tools=True)


@pytest.fixture
def plain() -> Harness:
    return build(Settings(), POLICY)


@pytest.fixture
def with_parser() -> Harness:
    return build(Settings(enable_auto_tool_choice=True), POLICY, output_parser=_pythonic())


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
        (_NAMED, 'tool_choice=function "weather" requires --tool-call-parser to be set'),
    ],
)
def test_without_a_parser_tool_choices_are_refused_as_vllm_refuses_them(
    plain: Harness, choice: Any, message: str
) -> None:
    error = assert_error(plain.post("/v1/chat/completions", {**_BODY, "tool_choice": choice}), 400)
    assert error["message"].startswith(message)
    assert plain.engine.calls == []


def test_tools_are_rendered_and_none_parses_nothing(plain: Harness) -> None:
    response = plain.post("/v1/chat/completions", _BODY)
    assert response.status_code == 200, response.text
    assert bytes(plain.engine.calls[-1][0]).decode().startswith("<tool>weather<user>hi")
    message = response.json()["choices"][0]["message"]
    assert "tool_calls" not in message  # as vLLM's: no key without calls
    assert message["content"]


@pytest.mark.parametrize("choice", ["required", _NAMED])
def test_required_and_named_choices_constrain_the_output_to_vllms_schema(
    with_parser: Harness, choice: Any
) -> None:
    response = with_parser.post("/v1/chat/completions", {**_BODY, "tool_choice": choice})
    assert response.status_code == 200, response.text
    constraint = with_parser.engine.calls[-1][1].structured_outputs
    assert constraint is not None
    assert constraint.json is not None


def test_auto_leaves_the_output_free(with_parser: Harness) -> None:
    response = with_parser.post("/v1/chat/completions", {**_BODY, "tool_choice": "auto"})
    assert response.status_code == 200, response.text
    assert with_parser.engine.calls[-1][1].structured_outputs is None


def _tool_calls(choice: Any, **fields: Any) -> ChatOutputParsing:
    request = ChatCompletionRequest.model_validate({**_BODY, "tool_choice": choice, **fields})
    return ChatOutputParsing(request, _pythonic(), FakeTokenizer(), auto_tools=True)


def test_auto_parses_the_models_calls_with_vllms_parser() -> None:
    _, content, calls, finish = _tool_calls("auto").parse(
        0, '[weather(city="Paris")]', [], [1], "stop"
    )
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"})
    ]
    assert content is None
    plain_text = _tool_calls("auto").parse(0, "no call here", [], [1], "stop")
    assert plain_text == (None, "no call here", [], "stop")


def test_required_parses_the_constrained_json() -> None:
    text = json.dumps([{"name": "weather", "parameters": {"city": "Oslo"}}])
    _, content, calls, finish = _tool_calls("required").parse(0, text, [], [1], "stop")
    assert (content, finish) == ("", "tool_calls")
    assert calls[0].function.name == "weather"
    named = _tool_calls(_NAMED).parse(0, '{"city": "Rome"}', [], [1], "stop")
    assert named[2][0].function.arguments == '{"city": "Rome"}'
    assert named[3] == "stop"


def test_a_stream_reports_tool_call_deltas_and_finishes_with_tool_calls() -> None:
    tools = _tool_calls("auto")
    pieces = ["[weather(", 'city="Paris")]']
    deltas = [
        tools.parse_delta(0, piece, [], [1], finished=i == len(pieces) - 1)
        for i, piece in enumerate(pieces)
    ]
    assert any(delta and delta.tool_calls for delta in deltas)
    assert tools.stream_finish_reason(0, "stop") == "tool_calls"
    assert tools.stream_finish_reason(1, "stop") == "stop"


def test_a_stream_cut_short_after_calls_keeps_the_engines_finish_reason() -> None:
    """vLLM's stream says `tool_calls` only when the engine's finish reason is `stop`."""
    tools = _tool_calls("auto")
    tools.parse_delta(0, '[weather(city="Paris")]', [], [1], finished=True)
    assert tools.stream_finish_reason(0, "stop") == "tool_calls"
    assert tools.stream_finish_reason(0, "length") == "length"
    assert tools.stream_finish_reason(0, "abort") == "abort"


_TWO_CALLS = '[weather(city="Paris"), weather(city="Rome")]'


@pytest.mark.parametrize(("parallel", "kept"), [(True, ["Paris", "Rome"]), (False, ["Paris"])])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel: bool, kept: list[str]) -> None:
    tools = _tool_calls("auto", parallel_tool_calls=parallel)
    _, _, calls, finish = tools.parse(0, _TWO_CALLS, [], [1], "stop")
    assert [json.loads(c.function.arguments)["city"] for c in calls] == kept
    assert finish == "tool_calls"


@pytest.mark.parametrize(("parallel", "indices"), [(True, {0, 1}), (False, {0})])
def test_parallel_tool_calls_false_streams_the_first_calls_deltas_only(
    parallel: bool, indices: set[int]
) -> None:
    tools = _tool_calls("auto", parallel_tool_calls=parallel)
    pieces = ["[weather(", 'city="Paris"), ', "weather(", 'city="Rome")]']
    deltas = [
        tools.parse_delta(0, piece, [], [1], finished=i == len(pieces) - 1)
        for i, piece in enumerate(pieces)
    ]
    assert {call.index for delta in deltas if delta for call in delta.tool_calls} == indices
    assert tools.stream_finish_reason(0, "stop") == "tool_calls"


def test_a_body_vllms_chat_model_refuses_is_a_400_with_tools(with_parser: Harness) -> None:
    messages = [{"role": "system", "content": "x", "name": None}, {"role": "user", "content": "y"}]
    body = {**_BODY, "messages": messages, "tool_choice": "auto"}
    error = assert_error(with_parser.post("/v1/chat/completions", body), 400)
    assert error["message"].startswith("vLLM's chat request refuses messages")
    assert with_parser.engine.calls == []


def test_a_tool_choice_without_tools_is_vllms_400(with_parser: Harness) -> None:
    body = {"messages": _BODY["messages"], "max_tokens": 2, "tool_choice": "required"}
    assert_error(with_parser.post("/v1/chat/completions", body), 400)


def test_a_tool_call_in_the_history_vllm_refuses_is_its_400(plain: Harness) -> None:
    """vLLM's renderer takes only function tool calls in an assistant's history
    (`_postprocess_messages`): chat and `/tokenize` answer its 400, nothing reaches the engine."""
    custom = {"id": "c", "type": "custom", "custom": {"name": "weather", "input": "Paris"}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [custom]},
        {"role": "user", "content": "and?"},
    ]
    for path in ("/v1/chat/completions", "/tokenize"):
        error = assert_error(plain.post(path, {**_BODY, "messages": history}), 400)
        assert "tool_calls of type 'function'" in error["message"], path
    assert plain.engine.calls == []
