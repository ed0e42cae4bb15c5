"""``--reasoning-parser`` (vLLM's flag, among `vllm_args`) with vLLM's own `deepseek_r1` parser
and the fake engine of server_fakes scripted to generate `<think>a</think>b`: the reasoning split
out of the content as vLLM's server splits it, streamed and not, dropped with
`include_reasoning: false` (logprobs and token ids too, as vLLM's), tool calls parsed after the
reasoning, the engine given the parser and whether the reasoning has ended, and a name vLLM does
not know refused in one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from server_fakes import MODEL, POLICY, FakeTokenizer, Harness, build, sse_events

from noisy_temp_server.server.engine import build_engine_args
from noisy_temp_server.server.protocol import ChatCompletionRequest
from noisy_temp_server.server.tools import ChatOutputParsing, output_parser_class
from noisy_temp_server.server.vllm_flags import engine_flag_overrides, frontend_options
from noisy_temp_server.settings import Settings

CHAT = "/v1/chat/completions"
_THINK, _END, _A, _B = 1, 2, 97, 98
_TEXTS = {_THINK: "<think>", _A: "a", _END: "</think>", _B: "b"}
_FLAGS = "--reasoning-parser deepseek_r1"


def _tokenizer() -> FakeTokenizer:
    return FakeTokenizer(special_tokens={"<think>": _THINK, "</think>": _END})


def _server(settings: Settings | None = None) -> Harness:
    """A server with vLLM's `deepseek_r1` parser whose engine answers `<think>a</think>b`."""
    settings = settings or Settings(vllm_args=_FLAGS)
    tokenizer = _tokenizer()
    reasoning = frontend_options(settings.vllm_args).reasoning_parser
    parser = output_parser_class(settings, reasoning, tokenizer, MODEL)
    server = build(settings, POLICY, tokenizer=tokenizer, output_parser=parser)
    server.engine.script = [_THINK, _A, _END, _B]
    server.engine.texts = _TEXTS
    return server


_USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _USER, "max_tokens": 4, **fields}


def _deltas(server: Harness, **fields: Any) -> list[dict[str, Any]]:
    response = server.post(CHAT, _chat(stream=True, **fields))
    assert response.status_code == 200, response.text
    return [
        choice["delta"]
        for chunk in sse_events(response)
        if chunk != "[DONE]"
        for choice in chunk["choices"]
    ]


def test_the_reasoning_is_split_out_of_the_content() -> None:
    server = _server()
    body = server.post(CHAT, _chat(logprobs=True)).json()
    choice = body["choices"][0]
    assert choice["message"]["reasoning"] == "a"
    assert choice["message"]["content"] == "b"
    assert len(choice["logprobs"]["content"]) == 4
    assert choice["nts"]["steps"] == 4  # T* applies to every token, the reasoning's too
    ended, kwargs = server.engine.reasoning[-1]
    assert ended is False  # the prompt does not end a reasoning: the engine's parser waits
    assert kwargs is not None
    assert kwargs["chat_template_kwargs"]["add_generation_prompt"] is True


def test_a_stream_sends_reasoning_deltas_then_content_deltas() -> None:
    deltas = _deltas(_server())
    assert "".join(d.get("reasoning") or "" for d in deltas) == "a"
    assert "".join(d.get("content") or "" for d in deltas) == "b"
    reasoning_at = next(i for i, d in enumerate(deltas) if d.get("reasoning"))
    content_at = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert reasoning_at < content_at
    assert len(deltas) == 3  # the role, "a", "b": no chunk for the think tags alone (vLLM's)


def test_include_reasoning_false_drops_the_reasoning_its_logprobs_and_token_ids() -> None:
    server = _server()
    hidden = {"include_reasoning": False, "logprobs": True, "return_token_ids": True}
    choice = server.post(CHAT, _chat(**hidden)).json()["choices"][0]
    assert choice["message"]["reasoning"] is None
    assert choice["message"]["content"] == "b"
    assert choice["logprobs"] is None
    assert "token_ids" not in choice
    assert server.engine.reasoning[-1][0] is True  # constrained from the first token, as vLLM's
    deltas = _deltas(server, include_reasoning=False)
    assert not any(d.get("reasoning") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "b"


def test_without_a_reasoning_parser_the_text_is_the_content() -> None:
    server = build(Settings(), POLICY, tokenizer=_tokenizer())
    server.engine.script, server.engine.texts = [_THINK, _A, _END, _B], _TEXTS
    message = server.post(CHAT, _chat()).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>a</think>b", "reasoning": None}
    assert server.engine.reasoning[-1] == (None, None)


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning() -> None:
    settings = Settings(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    parser = output_parser_class(settings, "deepseek_r1", _tokenizer(), MODEL)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    request = ChatCompletionRequest.model_validate(_chat(tools=[tool], tool_choice="auto"))
    parsing = ChatOutputParsing(request, parser, _tokenizer(), auto_tools=True)
    text = '<think>[weather(city="Oslo")]</think>[weather(city="Paris")]'
    reasoning, content, calls, finish = parsing.parse(0, text, [], [5], "stop")
    assert reasoning == '[weather(city="Oslo")]'
    assert [c.function.arguments for c in calls] == ['{"city": "Paris"}']
    assert (content, finish) == (None, "tool_calls")


def test_the_engine_gets_the_parser_for_its_structured_outputs(tiny_model_dir: Path) -> None:
    assert engine_flag_overrides(_FLAGS) == {"reasoning_parser": "deepseek_r1"}
    arguments = build_engine_args(Settings(vllm_args=_FLAGS), tiny_model_dir, "m")
    assert arguments.create_structured_outputs_config().reasoning_parser == "deepseek_r1"


def test_an_unknown_parser_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=re.escape("invalid reasoning parser: nope (chose from")):
        frontend_options("--reasoning-parser nope")


def test_a_parser_the_tokenizer_cannot_serve_is_refused_in_one_line() -> None:
    """vLLM's startup check (`serve` stops with this line once the tokenizer is read)."""
    with pytest.raises(TypeError) as refused:
        output_parser_class(Settings(), "deepseek_r1", FakeTokenizer(), MODEL)
    message = str(refused.value)
    assert message.startswith("--reasoning-parser deepseek_r1 cannot be used with the tokenizer")
    assert "\n" not in message


def test_a_plugin_registers_a_parser_of_its_own(tmp_path: Path) -> None:
    plugin = tmp_path / "my_reasoning_plugin.py"
    plugin.write_text(
        "from vllm.reasoning import ReasoningParserManager\n"
        "from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser\n"
        "ReasoningParserManager.register_module('my_think', module=DeepSeekR1ReasoningParser)\n"
    )
    plugged = f"--reasoning-parser-plugin {plugin} --reasoning-parser my_think"
    assert frontend_options(plugged).reasoning_parser == "my_think"
    body = _server(Settings(vllm_args=plugged)).post(CHAT, _chat()).json()
    assert body["choices"][0]["message"]["reasoning"] == "a"
    with pytest.raises(
        ValueError, match=re.escape("--reasoning-parser-plugin /no/such.py: cannot")
    ):
        frontend_options("--reasoning-parser-plugin /no/such.py")


def test_usage_counts_the_reasoning_tokens() -> None:
    """vLLM's `usage.completion_tokens_details.reasoning_tokens` (the parser's count: "a"),
    on every usage a chat answer reports, with a reasoning parser only."""
    server = _server()
    usage = server.post(CHAT, _chat()).json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 1}
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    response = server.post(CHAT, _chat(stream=True, stream_options=continuous))
    usages = [chunk["usage"] for chunk in sse_events(response) if chunk != "[DONE]"]
    counts = [u["completion_tokens_details"]["reasoning_tokens"] for u in usages]
    assert counts[0] == 0  # the opening chunk's
    assert counts[-1] == 1
    plain = build(Settings(), POLICY).post(CHAT, _chat()).json()["usage"]
    assert "completion_tokens_details" not in plain
