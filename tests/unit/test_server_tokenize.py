"""`POST /tokenize`'s chat form takes vLLM's chat-template fields with vLLM's meaning, renders
them as `/v1/chat/completions` does, refuses what vLLM's server refuses, and ignores fields it
does not define, as vLLM's does (the fake tokenizer of server_fakes: a character is its code
point; its template writes `<role>content`, the tools first, `<assistant>` to open a turn).
tests/e2e/test_openai_parity.py sends the same bodies to both real servers."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import POLICY, FakeTokenizer, Harness, assert_error, build

from noisy_temp_server.settings import Settings

_USER = [{"role": "user", "content": "a"}]
_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


class _GreetingTokenizer(FakeTokenizer):
    """A template that reads `greeting`, a key only `chat_template_kwargs` gives."""

    def __init__(self) -> None:
        super().__init__(chat_template="{{ messages }}{{ greeting }}")

    def apply_chat_template(  # type: ignore[override]
        self, conversation: list[dict[str, str]], *, tokenize: bool, greeting: str = "", **kw: Any
    ) -> str:
        return super().apply_chat_template(conversation, tokenize=tokenize, **kw) + greeting


@pytest.fixture
def server() -> Harness:
    return build(Settings(), POLICY, tokenizer=_GreetingTokenizer())


def _tokenized(server: Harness, **fields: Any) -> str:
    response = server.post("/tokenize", {"messages": _USER, **fields})
    assert response.status_code == 200, response.text
    return "".join(chr(t) for t in response.json()["tokens"])


@pytest.mark.parametrize(
    ("fields", "rendered"),
    [
        ({}, "<user>a<assistant>"),
        ({"tools": _TOOLS}, "<tool>weather<user>a<assistant>"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "<user>a"),
        ({"chat_template_kwargs": {"greeting": "!"}}, "<user>a<assistant>!"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "<user>a<assistant>"),
    ],
)
def test_tokenize_renders_the_chat_template_fields_as_chat_completions_does(
    server: Harness, fields: dict[str, Any], rendered: str
) -> None:
    """The request's own fields win over `chat_template_kwargs` (vLLM's `merge_kwargs`)."""
    assert _tokenized(server, **fields) == rendered
    chat = server.post(
        "/v1/chat/completions",
        {"messages": _USER, "max_tokens": 1, "return_prompt_text": True, **fields},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_text"] == rendered


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"chat_template": "{{ messages }}"}, "--trust-request-chat-template"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "--trust-request-chat-template"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "Cannot set both"),
        ({"mm_processor_kwargs": {"size": 1}}, "--trust-request-mm-kwargs"),
        ({"media_io_kwargs": {"image": {"a": 1}}}, "--trust-request-mm-kwargs"),
    ],
)
def test_tokenize_and_chat_refuse_what_vllm_refuses(
    server: Harness, fields: dict[str, Any], message: str
) -> None:
    for path in ("/tokenize", "/v1/chat/completions"):
        error = assert_error(server.post(path, {"messages": _USER, **fields}), 400)
        assert message in error["message"], (path, error)
    assert server.engine.calls == []


def test_tokenize_ignores_fields_it_does_not_define_nts_keys_too(server: Harness) -> None:
    """A chat request's body, keys of ours included, tokenizes as its messages."""
    body = {"max_tokens": 3, "stream": True, "nts_rule": "sqrt", "nts_tmax": 2.0, "bogus": 1}
    assert _tokenized(server, **body) == "<user>a<assistant>"
    response = server.post("/tokenize", {"prompt": "hi", "nts_tmax": 2.0, "bogus": [1]})
    assert response.json()["tokens"] == [104, 105]
    assert server.post("/detokenize", {"tokens": [104], "bogus": 1}).json() == {"prompt": "h"}
