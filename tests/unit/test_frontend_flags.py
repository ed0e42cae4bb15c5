"""vllm serve's server (frontend) flags on `serve` (`server.vllm_flags.FrontendOptions`), given
among vLLM's flags (the setting ``vllm_args``): each taken one changes what the server answers as
it changes vLLM's; every other one is refused in one line saying why, and `serve` exits 1."""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from server_fakes import MODEL, POLICY, FakeTokenizer, Harness, assert_error, build, sse_events
from uvicorn.config import LOGGING_CONFIG
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from noisy_temp_server import cli
from noisy_temp_server.server import engine as engine_module
from noisy_temp_server.server.launch import uvicorn_config
from noisy_temp_server.server.vllm_flags import (
    NOT_TAKEN,
    FrontendOptions,
    engine_flag_overrides,
    frontend_options,
)
from noisy_temp_server.settings import Settings

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_USER = [{"role": "user", "content": "hi"}]
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _serving(flags: str, tokenizer: FakeTokenizer | None = None) -> Harness:
    return build(Settings(vllm_args=flags), POLICY, tokenizer=tokenizer)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _USER, "max_tokens": 2, **fields}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _chunks(response: Any) -> list[dict[str, Any]]:
    return [chunk for chunk in sse_events(response) if chunk != "[DONE]"]


# ----------------------------------------------------------------------------- which flags


def _vllm_serve_parser() -> FlexibleArgumentParser:
    return make_arg_parser(FlexibleArgumentParser(add_help=False))


def test_every_server_flag_of_vllm_serve_is_taken_a_setting_or_refused() -> None:
    """Nothing `vllm serve --help` lists is accepted and ignored: each flag that is not the
    engine's is taken here, a setting of serve, or refused with why."""
    engine = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    taken = {field.name for field in dataclasses.fields(FrontendOptions)}
    flags = {action.dest for action in _vllm_serve_parser()._actions}
    for name in flags - engine:
        kinds = (name in taken, name in Settings.model_fields, name in NOT_TAKEN)
        assert sum(kinds) == 1, (name, kinds)
    assert taken | set(NOT_TAKEN) <= flags


def test_the_options_have_vllms_defaults() -> None:
    theirs, ours = vars(_vllm_serve_parser().parse_args([])), FrontendOptions()
    for field in dataclasses.fields(FrontendOptions):
        mine, vllms = getattr(ours, field.name), theirs[field.name]
        assert mine == vllms or not (mine or vllms), field.name  # an empty value for None


def _refused_argv(name: str) -> list[str]:
    """A non-default use of `vllm serve`'s flag `name`."""
    action = next(a for a in _vllm_serve_parser()._actions if a.dest == name)
    if not action.option_strings:
        return ["some/model"]  # the model, by position
    flag = next(s for s in action.option_strings if s.startswith("--") and "-no-" not in s[:5])
    if action.nargs == 0:
        return [f"--no-{flag[2:]}" if action.default is True else flag]
    if action.choices:
        return [flag, str(next(c for c in action.choices if c != action.default))]
    return [flag, "name=path" if name == "lora_modules" else "7"]


@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_each_flag_not_taken_is_refused_in_one_line_saying_why(name: str) -> None:
    flags = shlex.join(_refused_argv(name))
    for read in (frontend_options, engine_flag_overrides):
        with pytest.raises(ValueError, match=re.escape(NOT_TAKEN[name])) as refused:
            read(flags)
        message = str(refused.value)
        assert message.endswith(f": {NOT_TAKEN[name]}"), message
        assert "\n" not in message


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lora-modules", "a=b"], "--lora-modules: serve fits and loads its own adapter"),
        (["--tool-server", "demo"], "--tool-server: serve has no built-in tools"),
        (["--enable-per-request-metrics"], "--enable-per-request-metrics: serve's responses"),
        (["--response-role"], "argument --response-role: expected one argument"),
        (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--middleware", "no_such_module.M"], "--middleware no_such_module.M: cannot be"),
        (["--middleware", "middleware_fakes.NOT_MIDDLEWARE"], "Must be a function or a class"),
        (["--reasoning-parser", "nope"], "invalid reasoning parser: nope (chose from {"),
        (["--reasoning-parser-plugin", "no_such_plugin"], "no_such_plugin: cannot be imported"),
    ],
)
def test_serve_refuses_them_in_one_line_and_exits_1_before_anything_loads(
    argv: list[str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Environment:
        trace_endpoint = "ipc://unused"

        def cleanup(self) -> None:
            pass

    monkeypatch.setattr(engine_module, "prepare_environment", lambda settings: Environment())
    monkeypatch.setattr(engine_module, "start_engine", pytest.fail)
    with caplog.at_level(logging.ERROR, logger="noisy_temp_server.serve"):
        assert cli.main(["serve", *argv]) == 1
    (line,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert line.startswith("Refusing to serve: ")
    assert says in line
    assert "\n" not in line


def test_the_taken_flags_are_read_by_vllms_parser() -> None:
    options = frontend_options(
        "--response-role bot --enable-force-include-usage --middleware middleware_fakes."
        "TaggingMiddleware --middleware middleware_fakes.tagging_function "
        """--default-chat-template-kwargs '{"flavour": "mild"}' --h11-max-header-count 9"""
    )
    assert options.response_role == "bot"
    assert options.enable_force_include_usage is True
    assert options.middleware == (
        "middleware_fakes.TaggingMiddleware",
        "middleware_fakes.tagging_function",
    )
    assert options.default_chat_template_kwargs == {"flavour": "mild"}
    assert options.h11_max_header_count == 9
    assert options.return_tokens_as_token_ids is False  # vLLM's default for the others
    assert engine_flag_overrides("--response-role bot --seed 3") == {"seed": 3}


# ----------------------------------------------------------------------------- responses


def test_response_role_is_the_answers_role_when_the_request_opens_its_turn() -> None:
    """vLLM's `get_chat_request_role`: the flag's role with `add_generation_prompt`, else the
    last message's; `echo` repeats the last message when it has that role."""
    server = _serving("--response-role bot")
    assert server.post(CHAT, _chat()).json()["choices"][0]["message"]["role"] == "bot"
    first = _chunks(server.post(CHAT, _chat(stream=True)))[0]
    assert first["choices"][0]["delta"]["role"] == "bot"
    answered = [*_USER, {"role": "assistant", "content": "Sure"}]
    go_on = _chat(messages=answered, add_generation_prompt=False, continue_final_message=True)
    assert server.post(CHAT, go_on).json()["choices"][0]["message"]["role"] == "assistant"
    echoed = _chat(messages=answered, echo=True)
    assert (
        not server.post(CHAT, echoed).json()["choices"][0]["message"]["content"].startswith("Sure")
    )  # the last message is the assistant's, not the answer's role (bot)
    plain = _serving("")
    assert plain.post(CHAT, _chat()).json()["choices"][0]["message"]["role"] == "assistant"
    assert plain.post(CHAT, echoed).json()["choices"][0]["message"]["content"].startswith("Sure")


def test_return_tokens_as_token_ids_is_the_default_of_the_request_field() -> None:
    server = _serving("--return-tokens-as-token-ids")
    tokens = server.post(COMPLETIONS, _completion(logprobs=1)).json()["choices"][0]["logprobs"]
    assert tokens["tokens"] == ["token_id:2", "token_id:3"]  # the fake's: from the prompt's length
    chat = server.post(CHAT, _chat(logprobs=True)).json()["choices"][0]["logprobs"]["content"]
    assert all(entry["token"].startswith("token_id:") for entry in chat)
    asked_not = _completion(logprobs=1, return_tokens_as_token_ids=False)
    text = server.post(COMPLETIONS, asked_not).json()["choices"][0]["logprobs"]["tokens"]
    assert not any(token.startswith("token_id:") for token in text)
    plain = _serving("").post(COMPLETIONS, _completion(logprobs=1)).json()
    assert not plain["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_prompt_tokens_details_report_the_engines_cached_tokens() -> None:
    server = _serving("--enable-prompt-tokens-details")
    server.engine.cached_tokens = 3
    for path, body in ((COMPLETIONS, _completion()), (CHAT, _chat())):
        usage = server.post(path, body).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 3}
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        (last,) = [c for c in _chunks(server.post(path, stream)) if c.get("usage")]
        assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    server.engine.cached_tokens = None  # none reported: no details, as vLLM's
    assert "prompt_tokens_details" not in server.post(CHAT, _chat()).json()["usage"]
    plain = _serving("")
    plain.engine.cached_tokens = 3
    assert "prompt_tokens_details" not in plain.post(CHAT, _chat()).json()["usage"]


def test_force_include_usage_puts_usage_in_every_stream_on_every_chunk() -> None:
    server = _serving("--enable-force-include-usage")
    for path, body in ((COMPLETIONS, _completion(stream=True)), (CHAT, _chat(stream=True))):
        chunks = _chunks(server.post(path, body))
        assert all(chunk.get("usage") is not None for chunk in chunks), chunks
        assert chunks[-1]["usage"]["completion_tokens"] == 2
    plain = _chunks(_serving("").post(CHAT, _chat(stream=True)))
    assert not any("usage" in chunk for chunk in plain)


# ----------------------------------------------------------------------------- chat template


def _prompt_text(server: Harness, **fields: Any) -> str:
    response = server.post(CHAT, _chat(return_prompt_text=True, **fields))
    assert response.status_code == 200, response.text
    return str(response.json()["prompt_text"])


def test_default_chat_template_kwargs_are_under_the_requests_own() -> None:
    tokenizer = FakeTokenizer(chat_template="{{ messages }}{{ flavour }}")
    server = _serving("""--default-chat-template-kwargs '{"flavour": "mild"}'""", tokenizer)
    assert _prompt_text(server).startswith("<flavour=mild>")
    assert _prompt_text(server, chat_template_kwargs={"flavour": "hot"}).startswith("<flavour=hot>")
    tokenized = server.post("/tokenize", {"messages": _USER}).json()["tokens"]
    assert bytes(tokenized).decode().startswith("<flavour=mild>")
    assert not _prompt_text(_serving("", tokenizer)).startswith("<flavour")


def test_a_trusted_request_chat_template_is_the_one_rendered() -> None:
    server = _serving("--trust-request-chat-template")
    assert _prompt_text(server, chat_template="{{ messages }}!") == (
        "<template {{ messages }}!><user>hi<assistant>"
    )
    tokenized = server.post("/tokenize", {"messages": _USER, "chat_template": "T{{ messages }}"})
    assert bytes(tokenized.json()["tokens"]).decode().startswith("<template T{{ messages }}>")
    error = assert_error(_serving("").post(CHAT, _chat(chat_template="{{ messages }}!")), 400)
    assert "--trust-request-chat-template" in error["message"]


def test_tools_are_left_out_of_the_prompt_when_tool_choice_is_none() -> None:
    none = {"tools": _TOOLS, "tool_choice": "none"}
    assert "<tool>get_weather" not in _prompt_text(
        _serving("--exclude-tools-when-tool-choice-none"), **none
    )
    assert "<tool>get_weather" in _prompt_text(_serving(""), **none)


_PARTS = [{"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]}]
_LOOPS_OVER_CONTENT = (
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("flags", "template", "user"),
    [
        ("", "{{ messages }}", "a\nb"),  # auto: a template that prints the content whole
        ("", _LOOPS_OVER_CONTENT, str(_PARTS[0]["content"])),  # auto: one that loops over it
        ("--chat-template-content-format string", _LOOPS_OVER_CONTENT, "a\nb"),
        ("--chat-template-content-format openai", "{{ messages }}", str(_PARTS[0]["content"])),
    ],
)
def test_the_content_format_is_what_the_template_receives(
    flags: str, template: str, user: str
) -> None:
    """vLLM's: parts joined by newlines (`string`) or the list of parts (`openai`); `auto`
    detects which on the template (the fake tokenizer prints each message's content)."""
    server = _serving(flags, FakeTokenizer(chat_template=template))
    assert _tokenized(server, _PARTS) == f"<user>{user}<assistant>"  # as the chat route renders


def _tokenized(server: Harness, messages: list[dict[str, Any]]) -> str:
    tokens = server.post("/tokenize", {"messages": messages}).json()["tokens"]
    return bytes(tokens).decode()


def test_the_chat_route_renders_the_content_format_too() -> None:
    server = _serving("--chat-template-content-format openai")
    assert _prompt_text(server) == "<user>[{'type': 'text', 'text': 'hi'}]<assistant>"
    assert _prompt_text(_serving("")) == "<user>hi<assistant>"


def test_in_the_openai_format_a_string_is_one_part_and_a_tool_messages_parts_are_joined() -> None:
    server = _serving("--chat-template-content-format openai")
    tool_turn = [
        *_USER,
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "x"}] * 2},
    ]
    assert _tokenized(server, tool_turn) == (
        "<user>[{'type': 'text', 'text': 'hi'}]<assistant>[]<tool>x\nx<assistant>"
    )


# ----------------------------------------------------------------------------- HTTP


def test_fastapi_docs_are_served_unless_disabled() -> None:
    plain, disabled = _serving("").client, _serving("--disable-fastapi-docs").client
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert (plain.get(path).status_code, disabled.get(path).status_code) == (200, 404), path


def test_request_id_headers_answer_the_clients_id_or_a_new_one() -> None:
    client = _serving("--enable-request-id-headers").client
    assert re.fullmatch("[0-9a-f]{32}", client.get("/health").headers["x-request-id"])
    assert client.get("/health", headers={"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"
    assert "x-request-id" not in _serving("").client.get("/health").headers


def test_middleware_classes_and_functions_are_added_as_vllm_adds_them() -> None:
    client = _serving(
        "--middleware middleware_fakes.TaggingMiddleware "
        "--middleware middleware_fakes.tagging_function"
    ).client
    headers = client.post(CHAT, json=_chat()).headers
    assert (headers["x-tagged-by"], headers["x-tagged-by-function"]) == ("class", "yes")
    with pytest.raises(ValueError, match="Must be a function or a class"):
        _serving("--middleware middleware_fakes.NOT_MIDDLEWARE")


def test_uvicorn_gets_the_socket_ciphers_h11_limits_and_access_log_filter() -> None:
    flags = (
        "--uds /tmp/nts.sock --ssl-ciphers ECDHE-RSA-AES256-GCM-SHA384 "
        "--h11-max-incomplete-event-size 1000 --h11-max-header-count 10 "
        "--disable-access-log-for-endpoints /health,/metrics"
    )
    config = uvicorn_config(Settings(vllm_args=flags), object(), "info")
    assert (config.uds, config.ssl_ciphers) == ("/tmp/nts.sock", "ECDHE-RSA-AES256-GCM-SHA384")
    assert (config.h11_max_incomplete_event_size, config.h11_max_header_count) == (1000, 10)
    access_filter = config.log_config["filters"]["access_log_filter"]
    assert access_filter["excluded_paths"] == ["/health", "/metrics"]
    default = uvicorn_config(Settings(), object(), "info")
    assert (default.uds, default.ssl_ciphers, default.log_config) == (None, None, LOGGING_CONFIG)
    assert (default.h11_max_incomplete_event_size, default.h11_max_header_count) == (4194304, 256)


def test_the_server_answers_on_its_unix_socket(tmp_path: Path) -> None:
    socket = tmp_path / "nts.sock"
    settings = Settings(vllm_args=f"--uds {socket}")
    server = uvicorn.Server(uvicorn_config(settings, build(settings, POLICY).client.app, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        transport = httpx.HTTPTransport(uds=str(socket))
        with httpx.Client(transport=transport, base_url="http://nts") as client:
            assert client.get("/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
