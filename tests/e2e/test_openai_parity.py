"""Differential: our server and vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.
api_server`) on the tiny model, each started once, answer one matrix of requests with the same
status codes and the same response shapes.

The shape of a body is the set of its key paths (`choices[].message.content`: lists merged);
a stream's is the union over its chunks. For every row: the same status; every key path of ours
is one of vLLM's too, once the `nts` objects are left out (we answer nothing vLLM does not,
but `nts`); vLLM's key paths that ours lacks are all in `VLLM_ONLY` (vLLM's extensions we do not
answer; docs/serving.md lists them); and ours carries the `nts` object where a response does
(the stream's last chunk). Texts are not compared (ours serves the tiny model perturbed by
weight noise), but a constrained output must satisfy its constraint on both.

`KNOWN_DIFFERENCES` holds the rows where the servers still differ, with both statuses, so that
the day ours catches up the test says so.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from server_helpers import free_port, running_server, stop
from tiny_serve import API_KEY, MODEL, start_tiny_server
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    TokenizeChatRequest as VllmTokenizeChatRequest,
)
from vllm.entrypoints.serve.tokenize.protocol import (
    TokenizeCompletionRequest as VllmTokenizeCompletionRequest,
)

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 600
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
_CHAT = {"messages": [{"role": "user", "content": "Say something."}]}
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "obj", "schema": _SCHEMA}}

VLLM_ONLY = frozenset(
    {
        "system_fingerprint",
        "metrics",
        "prompt_text",
        "ec_transfer_params",
        "usage.completion_tokens_details",
        "choices[].routed_experts",
        "data[].parent",
        "data[].permission",
        "service_tier",
        "kv_transfer_params",
        "prompt_logprobs",
        "prompt_token_ids",
        "usage.prompt_tokens_details",
        "usage.prompt_tokens_details.created_cache_tokens",
        "usage.prompt_tokens_details.multimodal_tokens",
        "choices[].stop_reason",
        "choices[].token_ids",
        "choices[].prompt_logprobs",
        "choices[].prompt_token_ids",
        "choices[].message.refusal",
        "choices[].message.annotations",
        "choices[].message.audio",
        "choices[].message.function_call",
        "choices[].message.tool_calls",
        "choices[].message.reasoning",
        "choices[].message.reasoning_content",
        "choices[].delta.reasoning",
        "choices[].delta.reasoning_content",
        "choices[].delta.tool_calls",
    }
)
"""vLLM's key paths that ours does not answer (its extensions and OpenAI's optional nulls)."""


@dataclass(frozen=True)
class Row:
    name: str
    path: str
    body: dict[str, Any] | None = None
    check: Callable[[str], None] | None = None
    """Checks each choice's text (the constraint held)."""
    nts: bool = True
    params: dict[str, Any] = field(default_factory=dict)
    reports: tuple[str, ...] = ()
    """Key paths both servers must answer with a value (not null) in some body or chunk."""
    body_check: Callable[[Any], None] | None = None
    """Checks each body (each chunk of a stream) of both servers."""
    headers: dict[str, str] = field(default_factory=dict)
    """Sent on top of the API key's."""


def _is_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def _one_of(*options: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in options, text

    return check


def _matches(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The answer is", "max_tokens": 8, "seed": 1, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, **_CHAT, "max_tokens": 8, "seed": 1, **fields}


ROWS = [
    Row("completion", "/v1/completions", _completion()),
    Row("chat", "/v1/chat/completions", _chat()),
    Row(
        "completion json_object",
        "/v1/completions",
        _completion(response_format={"type": "json_object"}, max_tokens=40),
    ),
    Row("chat json_schema", "/v1/chat/completions", _chat(response_format=_JSON_SCHEMA)),
    Row("completion json_schema", "/v1/completions", _completion(response_format=_JSON_SCHEMA)),
    Row(
        "chat choice",
        "/v1/chat/completions",
        _chat(structured_outputs={"choice": ["yes", "no"]}),
        _one_of("yes", "no"),
    ),
    Row(
        "completion regex",
        "/v1/completions",
        _completion(structured_outputs={"regex": "[ab]{3}"}),
        _matches("[ab]{3}"),
    ),
    Row(
        "completion grammar",
        "/v1/completions",
        _completion(structured_outputs={"grammar": 'root ::= "up" | "down"'}),
        _one_of("up", "down"),
    ),
    Row("completion json", "/v1/completions", _completion(structured_outputs={"json": _SCHEMA})),
    Row(
        "chat stream json_object",
        "/v1/chat/completions",
        _chat(response_format={"type": "json_object"}, stream=True),
    ),
    Row("min_tokens", "/v1/completions", _completion(min_tokens=4, max_tokens=4)),
    Row("list of prompts", "/v1/completions", _completion(prompt=["a", "b c"], n=2)),
    Row(
        "list of token id prompts, echo",
        "/v1/completions",
        _completion(prompt=[[5, 6], [7]], echo=True, max_tokens=2),
    ),
    Row(
        "list of prompts, streamed with usage",
        "/v1/completions",
        _completion(prompt=["a", "b"], stream=True, stream_options={"include_usage": True}),
    ),
    Row("suffix", "/v1/completions", _completion(suffix="end"), nts=False),
    Row(
        "json_schema without a schema",
        "/v1/completions",
        _completion(response_format={"type": "json_schema"}),
        nts=False,
    ),
    Row(
        "two constraints",
        "/v1/completions",
        _completion(structured_outputs={"regex": "a", "choice": ["a"]}),
        nts=False,
    ),
    Row(
        "empty choice", "/v1/chat/completions", _chat(structured_outputs={"choice": []}), nts=False
    ),
    Row("bad regex", "/v1/completions", _completion(structured_outputs={"regex": "(("}), nts=False),
    Row("min_tokens over max_tokens", "/v1/completions", _completion(min_tokens=9), nts=False),
    Row("tokenize", "/tokenize", {"model": MODEL, "prompt": "hello", "return_token_strs": True}),
    Row("tokenize chat", "/tokenize", {"model": MODEL, **_CHAT}),
    Row("detokenize", "/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}),
    Row("tokenize unknown model", "/tokenize", {"model": "nope", "prompt": "x"}, nts=False),
    Row("version", "/version"),
    Row("models", "/v1/models"),
]
_SAMPLING_FIELDS = {
    "top_k": 5,
    "min_p": 0.05,
    "stop_token_ids": [2],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "allowed_token_ids": [5, 6, 7, 8],
    "bad_words": ["the"],
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "stream_interval": 2,
    "length_penalty": 1.0,
    "use_beam_search": False,
    "watermarking": None,
    "thinking_token_budget": None,
    "routed_experts_prompt_start": 0,
    "logit_bias": {"5": 1.0},
    "repetition_penalty": 1.1,
    "ignore_eos": True,
    "user": "u",
}
_REQUEST_FIELDS = {
    "request_id": "parity",
    "session_id": "s",
    "priority": 0,
    "cache_salt": "salt",
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "return_token_offsets": False,
    "mm_payload": "tensors",
    "return_mm_kwargs": None,
    "vllm_xargs": {"x": 1},
    "truncate_prompt_tokens": 3,
    "truncation_side": "left",
}
_ASSISTANT_LAST = [
    {"role": "user", "content": "Say something."},
    {"role": "assistant", "content": "Well"},
]
_OPENAI_FIELDS = {
    "n": 2,
    "stop": ["zz"],
    "temperature": 0.8,
    "top_p": 0.9,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "min_tokens": 1,
}
ROWS += [
    Row(
        "completion, OpenAI's fields",
        "/v1/completions",
        _completion(
            **_OPENAI_FIELDS, logprobs=2, stream=True, stream_options={"include_usage": True}
        ),
    ),
    Row(
        "chat, OpenAI's fields",
        "/v1/chat/completions",
        _chat(**_OPENAI_FIELDS, logprobs=True, top_logprobs=2, max_completion_tokens=4),
    ),
    Row(
        "chat, OpenAI's fields streamed",
        "/v1/chat/completions",
        _chat(**_OPENAI_FIELDS, stream=True, stream_options={"include_usage": True}),
    ),
    Row("completion, prompt_logprobs", "/v1/completions", _completion(prompt_logprobs=2)),
    Row("chat, prompt_logprobs", "/v1/chat/completions", _chat(prompt_logprobs=1)),
    Row(
        "completion, echo with logprobs and prompt_logprobs",
        "/v1/completions",
        _completion(echo=True, logprobs=1, prompt_logprobs=2),
    ),
    Row(
        "prompt_logprobs in a stream",
        "/v1/chat/completions",
        _chat(prompt_logprobs=1, stream=True),
        nts=False,
    ),
    Row("completion, vLLM's sampling fields", "/v1/completions", _completion(**_SAMPLING_FIELDS)),
    Row("chat, vLLM's sampling fields", "/v1/chat/completions", _chat(**_SAMPLING_FIELDS)),
    Row(
        "completion, vLLM's request fields",
        "/v1/completions",
        _completion(**_REQUEST_FIELDS, add_special_tokens=False),
    ),
    Row("chat, vLLM's request fields", "/v1/chat/completions", _chat(**_REQUEST_FIELDS, n=2)),
    Row(
        "chat, template fields",
        "/v1/chat/completions",
        _chat(
            messages=_ASSISTANT_LAST,
            add_generation_prompt=False,
            continue_final_message=True,
            echo=True,
            add_special_tokens=True,
            documents=[{"title": "t", "text": "x"}],
            chat_template_kwargs={"unused": 1},
            reasoning_effort="low",
            include_reasoning=True,
            parallel_tool_calls=True,
            media_io_kwargs=None,
            mm_processor_kwargs=None,
        ),
    ),
    Row("chat echo, streamed", "/v1/chat/completions", _chat(echo=True, stream=True)),
    Row(
        "completion, truncate to the context",
        "/v1/completions",
        _completion(prompt="word " * 300, truncate_prompt_tokens=-1, max_tokens=1),
    ),
    Row(
        "truncation past the context",
        "/v1/completions",
        _completion(truncate_prompt_tokens=300),
        nts=False,
    ),
    Row("top_k below -1", "/v1/completions", _completion(top_k=-2), nts=False),
    Row("min_p above 1", "/v1/chat/completions", _chat(min_p=2.0), nts=False),
    Row("bad cache_salt", "/v1/completions", _completion(cache_salt="a/b"), nts=False),
    Row(
        "chat_template in the request",
        "/v1/chat/completions",
        _chat(chat_template="{{ messages }}"),
        nts=False,
    ),
    Row(
        "both generation prompt and continuation",
        "/v1/chat/completions",
        _chat(add_generation_prompt=True, continue_final_message=True),
        nts=False,
    ),
]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
_NAMED = {"type": "function", "function": {"name": "weather"}}
_TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
ROWS += [
    Row("tools, tool_choice none", "/v1/chat/completions", _chat(tools=_TOOLS)),
    Row("tools, auto", "/v1/chat/completions", _chat(tools=_TOOLS, tool_choice="auto")),
    Row(
        "tools, required",
        "/v1/chat/completions",
        _chat(tools=_TOOLS, tool_choice="required", max_tokens=60),
    ),
    Row("tools, named", "/v1/chat/completions", _chat(tools=_TOOLS, tool_choice=_NAMED)),
    Row(
        "tools, auto, streamed",
        "/v1/chat/completions",
        _chat(tools=_TOOLS, tool_choice="auto", stream=True),
    ),
    Row(
        "tools, required, streamed",
        "/v1/chat/completions",
        _chat(tools=_TOOLS, tool_choice="required", stream=True, max_tokens=60),
    ),
    Row(
        "tools, history with a call and its result",
        "/v1/chat/completions",
        _chat(messages=_TOOL_HISTORY, tools=_TOOLS, parallel_tool_calls=False),
    ),
    Row(
        "tools, named function not among them",
        "/v1/chat/completions",
        _chat(tools=_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        nts=False,
    ),
    Row(
        "tools, tool_choice without tools",
        "/v1/chat/completions",
        _chat(tool_choice="required"),
        nts=False,
    ),
]
_TOKENIZE_CHAT = {"model": MODEL, **_CHAT}
ROWS += [
    Row(
        "tokenize chat, template fields",
        "/tokenize",
        {
            **_TOKENIZE_CHAT,
            "messages": _ASSISTANT_LAST,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"unused": 1},
            "add_special_tokens": True,
            "return_token_strs": True,
            "media_io_kwargs": None,
            "mm_processor_kwargs": None,
        },
    ),
    Row(
        "tokenize chat, tools and a call's history",
        "/tokenize",
        {**_TOKENIZE_CHAT, "messages": _TOOL_HISTORY, "tools": _TOOLS},
    ),
    Row(
        "tokenize a chat request's body, keys of ours included",
        "/tokenize",
        {**_chat(stream=True, n=2, nts_t=1.0, nts_tmax=2.0), "bogus": 1},
    ),
    Row("tokenize, unknown fields", "/tokenize", {"model": MODEL, "prompt": "x", "bogus": [1]}),
    Row("detokenize, unknown fields", "/detokenize", {"model": MODEL, "tokens": [5], "x": 1}),
    Row(
        "tokenize chat_template in the request",
        "/tokenize",
        {**_TOKENIZE_CHAT, "chat_template": "{{ messages }}"},
    ),
    Row(
        "tokenize chat_template in chat_template_kwargs",
        "/tokenize",
        {**_TOKENIZE_CHAT, "chat_template_kwargs": {"chat_template": "{{ messages }}"}},
    ),
    Row(
        "tokenize both generation prompt and continuation",
        "/tokenize",
        {**_TOKENIZE_CHAT, "add_generation_prompt": True, "continue_final_message": True},
    ),
    Row(
        "tokenize mm_processor_kwargs",
        "/tokenize",
        {**_TOKENIZE_CHAT, "mm_processor_kwargs": {"size": 1}},
    ),
    Row(
        "chat media_io_kwargs",
        "/v1/chat/completions",
        _chat(media_io_kwargs={"image": {"a": 1}}),
        nts=False,
    ),
]
_RESPONSE = {"model": MODEL, "input": "Hi", "max_output_tokens": 8}
ROWS += [
    Row("responses", "/v1/responses", _RESPONSE),
    Row("responses, streamed", "/v1/responses", {**_RESPONSE, "stream": True}),
    Row(
        "responses, instructions and sampling",
        "/v1/responses",
        {**_RESPONSE, "instructions": "Be brief.", "temperature": 0.7, "top_p": 0.9},
    ),
    Row("responses, unknown model", "/v1/responses", {**_RESPONSE, "model": "nope"}),
]


def _logprob_tokens(body: Any) -> list[str]:
    """The token names of a body's logprobs (chat's and the legacy completions'), candidates
    included."""
    names: list[str] = []
    for choice in body.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        for position in logprobs.get("content") or []:
            names += [position["token"], *(t["token"] for t in position["top_logprobs"])]
        names += logprobs.get("tokens") or []
        names += [name for top in logprobs.get("top_logprobs") or [] for name in top or {}]
    return names


def _without_the_prompt(text: str) -> None:
    assert not text.startswith(_completion()["prompt"]), text


def _tokens_named_by_id(body: Any) -> None:
    for name in _logprob_tokens(body):
        assert re.fullmatch("token_id:[0-9]+", name), name


def _candidates_include_5(body: Any) -> None:
    for choice in body.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        positions = [
            {t["token"] for t in p["top_logprobs"]} for p in logprobs.get("content") or []
        ] + [set(top or {}) for top in logprobs.get("top_logprobs") or []]
        assert all("token_id:5" in p for p in positions), positions


_IDS = ("prompt_token_ids", "choices[].token_ids")
_COMPLETION_IDS = ("choices[].prompt_token_ids", "choices[].token_ids")
_BY_ID = {"return_tokens_as_token_ids": True}
_ONLY_5 = {"logprob_token_ids": [5], **_BY_ID}
ROWS += [
    Row(
        "chat return_token_ids", "/v1/chat/completions", _chat(return_token_ids=True), reports=_IDS
    ),
    Row(
        "chat return_token_ids, streamed",
        "/v1/chat/completions",
        _chat(return_token_ids=True, stream=True, n=2),
        reports=_IDS,
    ),
    Row(
        "chat return_prompt_text",
        "/v1/chat/completions",
        _chat(return_prompt_text=True),
        reports=("prompt_text",),
    ),
    Row(
        "chat return_prompt_text, streamed",
        "/v1/chat/completions",
        _chat(return_prompt_text=True, stream=True),
        reports=("prompt_text",),
    ),
    Row(
        "chat return_tokens_as_token_ids",
        "/v1/chat/completions",
        _chat(**_BY_ID, logprobs=True, top_logprobs=2),
        body_check=_tokens_named_by_id,
    ),
    Row(
        "chat logprob_token_ids",
        "/v1/chat/completions",
        _chat(logprob_token_ids=[5], logprobs=True),
    ),
    Row(
        "chat logprob_token_ids, by id, streamed",
        "/v1/chat/completions",
        _chat(**_ONLY_5, logprobs=True, stream=True),
        body_check=_candidates_include_5,
    ),
    Row(
        "completion return_token_ids",
        "/v1/completions",
        _completion(return_token_ids=True, prompt=["a", "b c"]),
        reports=_COMPLETION_IDS,
    ),
    Row(
        "completion return_token_ids, streamed",
        "/v1/completions",
        _completion(return_token_ids=True, stream=True, n=2),
        reports=_COMPLETION_IDS,
    ),
    Row(
        "completion echo with return_token_ids: no prompt text",
        "/v1/completions",
        _completion(return_token_ids=True, echo=True),
        _without_the_prompt,
        reports=_COMPLETION_IDS,
    ),
    Row(
        "completion return_tokens_as_token_ids",
        "/v1/completions",
        _completion(**_BY_ID, logprobs=2),
        body_check=_tokens_named_by_id,
    ),
    Row(
        "completion logprob_token_ids, by id",
        "/v1/completions",
        _completion(**_ONLY_5, logprobs=1),
        body_check=_candidates_include_5,
    ),
    Row(
        "logprob_token_ids without logprobs",
        "/v1/chat/completions",
        _chat(logprob_token_ids=[5]),
        nts=False,
    ),
]


def _with_the_prompt(text: str) -> None:
    assert text.startswith(_completion()["prompt"]), text


ROWS += [
    Row(
        "completion echo, streamed",
        "/v1/completions",
        _completion(echo=True, stream=True, n=2),
        _with_the_prompt,
    ),
    Row(
        "completion echo with logprobs, streamed with usage",
        "/v1/completions",
        _completion(echo=True, logprobs=1, stream=True, stream_options={"include_usage": True}),
        _with_the_prompt,
    ),
    Row(
        "completion echo without generation, streamed",
        "/v1/completions",
        _completion(echo=True, max_tokens=0, logprobs=0, stream=True),
        _matches(_completion()["prompt"]),
    ),
    Row(
        "completion echo of token id prompts, streamed",
        "/v1/completions",
        _completion(prompt=[[5, 6], [7]], echo=True, stream=True, max_tokens=2),
    ),
    Row(
        "completion echo with return_token_ids, streamed: no prompt text",
        "/v1/completions",
        _completion(echo=True, return_token_ids=True, stream=True),
        _without_the_prompt,
        reports=_COMPLETION_IDS,
    ),
]


def _sampled_first_then_by_logprob(body: Any) -> None:
    """vLLM's order of chat `top_logprobs`: the sampled token, then the others best first."""
    for choice in body.get("choices", []):
        for position in (choice.get("logprobs") or {}).get("content") or []:
            top = position["top_logprobs"]
            assert [t["token"] for t in top[:1]] == [position["token"]], position
            others = [t["logprob"] for t in top[1:]]
            assert others == sorted(others, reverse=True), position


_TOP_3 = {"logprobs": True, "top_logprobs": 3}
ROWS += [
    Row(
        "chat top_logprobs order, greedy",
        "/v1/chat/completions",
        _chat(**_TOP_3, temperature=0),
        body_check=_sampled_first_then_by_logprob,
    ),
    Row(
        "chat top_logprobs order, sampled, streamed",
        "/v1/chat/completions",
        _chat(**_TOP_3, temperature=1.0, max_tokens=24, stream=True),
        body_check=_sampled_first_then_by_logprob,
    ),
]


def _choices(count: int) -> Callable[[Any], None]:
    def check(body: Any) -> None:
        assert len(body["choices"]) == count, body["choices"]

    return check


_BEAM = {"use_beam_search": True, "n": 2}
ROWS += [
    Row("beam search", "/v1/completions", _completion(**_BEAM), body_check=_choices(2)),
    Row(
        "beam search, two prompts, logprobs",
        "/v1/completions",
        _completion(**_BEAM, prompt=["a", "b c"], logprobs=1, length_penalty=0.5),
        body_check=_choices(4),
    ),
    Row("chat beam search", "/v1/chat/completions", _chat(**_BEAM), body_check=_choices(2)),
    Row(
        "chat beam search, logprobs, streamed",
        "/v1/chat/completions",
        _chat(**_BEAM, logprobs=True, stream=True),
    ),
    Row(
        "beam search streamed on completions",
        "/v1/completions",
        _completion(**_BEAM, stream=True),
        nts=False,
    ),
    Row(
        "beam search, echo with logprobs",
        "/v1/completions",
        _completion(**_BEAM, echo=True, logprobs=1),
        nts=False,
    ),
    Row(
        "beam search with logprob_token_ids",
        "/v1/chat/completions",
        _chat(**_BEAM, logprobs=True, logprob_token_ids=[5]),
        nts=False,
    ),
    Row("prompt_embeds", "/v1/completions", _completion(prompt_embeds="AAAA"), nts=False),
    Row(
        "a prompt the tokenizer refuses",
        "/v1/completions",
        _completion(prompt="a\ud800"),
        nts=False,
    ),
    Row("tokenize what the tokenizer refuses", "/tokenize", {"model": MODEL, "prompt": "\ud800"}),
]


def _id_is(expected: str) -> Callable[[Any], None]:
    def check(body: Any) -> None:
        assert body.get("id") == expected, body.get("id")

    return check


def _finish_reasons_are(*reasons: str) -> Callable[[Any], None]:
    def check(body: Any) -> None:
        for choice in body.get("choices", []):
            assert choice.get("finish_reason") in (None, *reasons), choice

    return check


_CUSTOM_CALL = {"id": "c", "type": "custom", "custom": {"name": "weather", "input": "Paris"}}
ROWS += [
    Row(
        "chat, stream_options null", "/v1/chat/completions", _chat(stream=True, stream_options=None)
    ),
    Row(
        "chat, continuous_usage_stats null",
        "/v1/chat/completions",
        _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": None}),
        reports=("usage.total_tokens",),
    ),
    Row(
        "completion, empty stream_options without stream",
        "/v1/completions",
        _completion(stream_options={}),
    ),
    Row(
        "chat, X-Request-Id header over request_id",
        "/v1/chat/completions",
        _chat(request_id="from-body"),
        headers={"X-Request-Id": "from-header"},
        body_check=_id_is("chatcmpl-from-header"),
    ),
    Row(
        "completion, X-Request-Id header, streamed",
        "/v1/completions",
        _completion(stream=True),
        headers={"X-Request-Id": "from-header"},
        body_check=_id_is("cmpl-from-header"),
    ),
    Row(
        "tools, auto, parallel_tool_calls false, streamed",
        "/v1/chat/completions",
        _chat(tools=_TOOLS, tool_choice="auto", parallel_tool_calls=False, stream=True),
    ),
    Row(
        "tools, required, streamed, cut short",
        "/v1/chat/completions",
        _chat(tools=_TOOLS, tool_choice="required", stream=True, max_tokens=4),
        body_check=_finish_reasons_are("length"),
    ),
    Row(
        "tools, a call not of type function in the history",
        "/v1/chat/completions",
        _chat(messages=[*_CHAT["messages"], {"role": "assistant", "tool_calls": [_CUSTOM_CALL]}]),
        nts=False,
    ),
    Row(
        "tokenize chat, keys vLLM does not pass to the template",
        "/tokenize",
        {
            **_TOKENIZE_CHAT,
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
                {"role": "user", "content": "hi", "name": "ann", "task": "t", "custom": 1},
                *_TOOL_HISTORY[1:],
            ],
        },
    ),
]
SHARED_FLAGS = (
    *("--enable-auto-tool-choice", "--tool-call-parser", "pythonic"),
    *("--response-role", "bot", "--enable-prompt-tokens-details"),
    *("--reasoning-parser", "deepseek_v3", "--chat-template-content-format", "auto"),
)
"""Both servers parse tool calls with vLLM's pythonic parser (one the tiny tokenizer serves),
answer chat as `bot`, report the prompt's cached tokens (vLLM's server flags) and run vLLM's
`deepseek_v3` reasoning parser (one the tiny tokenizer serves: without `thinking` among the
template's arguments it finds no reasoning, so texts and constraints are as without it)."""


def _no_logprobs_nor_token_ids(body: Any) -> None:
    """vLLM's with a parser and `include_reasoning: false`: they would show the reasoning."""
    for choice in body.get("choices", []):
        assert choice.get("logprobs") is None, choice
        assert choice.get("token_ids") is None, choice


def _parts_joined_by_newlines(body: Any) -> None:
    if "prompt_text" in body:
        assert "Say\nsomething." in body["prompt_text"], body["prompt_text"]


_HIDDEN = {"include_reasoning": False, "logprobs": True, "return_token_ids": True}
_PARTS = [{"role": "user", "content": [{"type": "text", "text": t} for t in ("Say", "something.")]}]
ROWS += [
    Row(
        "chat, include_reasoning false",
        "/v1/chat/completions",
        _chat(**_HIDDEN),
        body_check=_no_logprobs_nor_token_ids,
        reports=("usage.completion_tokens_details.reasoning_tokens",),
    ),
    Row(
        "chat, include_reasoning false, streamed",
        "/v1/chat/completions",
        _chat(**_HIDDEN, stream=True),
        body_check=_no_logprobs_nor_token_ids,
    ),
    Row(
        "chat, text parts",
        "/v1/chat/completions",
        _chat(messages=_PARTS, return_prompt_text=True),
        body_check=_parts_joined_by_newlines,
        reports=("prompt_text",),
    ),
]


def _answers_as_bot(body: Any) -> None:
    """Every message's role, and every delta's that names one, is `bot` (`--response-role`)."""
    for choice in body.get("choices", []):
        if "message" in choice:
            assert choice["message"]["role"] == "bot", body
        elif choice.get("delta", {}).get("role") is not None:
            assert choice["delta"]["role"] == "bot", body


_CACHED = ("usage.prompt_tokens_details.cached_tokens",)
_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
ROWS += [
    Row("chat, --response-role", "/v1/chat/completions", _chat(), body_check=_answers_as_bot),
    Row(
        "chat streamed, --response-role and --enable-prompt-tokens-details",
        "/v1/chat/completions",
        _chat(**_WITH_USAGE),
        body_check=_answers_as_bot,
        reports=(*_CACHED, "choices[].delta.role"),
    ),
    Row(
        "completion, --enable-prompt-tokens-details",
        "/v1/completions",
        _completion(),
        reports=_CACHED,
    ),
    Row(
        "completion streamed, --enable-prompt-tokens-details",
        "/v1/completions",
        _completion(**_WITH_USAGE),
        reports=_CACHED,
    ),
]
NO_NTS_PATHS = ("/tokenize", "/detokenize", "/version", "/v1/models", "/v1/responses")


def _usage_on_every_chunk(body: Any) -> None:
    assert body.get("usage") is not None, body


_CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
ROWS += [
    Row(
        "chat stream_options.continuous_usage_stats",
        "/v1/chat/completions",
        _chat(stream=True, stream_options=_CONTINUOUS, n=2),
        body_check=_usage_on_every_chunk,
    ),
    Row(
        "completion stream_options.continuous_usage_stats",
        "/v1/completions",
        _completion(prompt=["a", "b c"], stream=True, stream_options=_CONTINUOUS),
        body_check=_usage_on_every_chunk,
    ),
]
ROWS += [
    Row("unknown fields", "/v1/completions", _completion(bogus=1, metadata={"a": "b"})),
    Row("chat, unknown fields", "/v1/chat/completions", _chat(bogus=[1], store=False)),
    Row(
        "stream_options, unknown key",
        "/v1/chat/completions",
        _chat(stream=True, stream_options={"include_usage": True, "bogus": True}),
    ),
]
KNOWN_DIFFERENCES = {
    "misspelt nts key": (Row("nts_tmax", "/v1/completions", _completion(nts_tmax=2.0)), 400, 200),
}
"""Rows where ours still differs: (row, our status, vLLM's status)."""


@pytest.fixture(scope="module")
def ours(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_tiny_server(
        tiny_model_dir, tmp_path_factory.mktemp("parity-ours"), *SHARED_FLAGS
    )
    try:
        yield server.url
    finally:
        stop(server.process)


@pytest.fixture(scope="module")
def stock(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("NTS_POLICY_FILE", None)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model_dir),
        "--served-model-name", MODEL,
        "--api-key", API_KEY,
        "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", "256", "--dtype", "float32", "--enforce-eager", *SHARED_FLAGS,
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("parity-stock") / "server.log"
    with running_server(
        "stock vLLM server", command, port=port, log=log, timeout_s=START_TIMEOUT_S, env=env
    ) as url:
        yield url


@dataclass
class Answer:
    status: int
    bodies: list[Any]
    """The JSON body, or a stream's chunks."""


def _ask(url: str, row: Row) -> Answer:
    if row.body is None:
        reply = httpx.get(f"{url}{row.path}", headers={**HEADERS, **row.headers}, timeout=300)
    else:
        body = json.dumps(row.body)  # ASCII escapes: a lone surrogate is valid JSON this way
        headers = {**HEADERS, **row.headers, "Content-Type": "application/json"}
        reply = httpx.post(f"{url}{row.path}", content=body, headers=headers, timeout=300)
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return Answer(reply.status_code, chunks)
    return Answer(reply.status_code, [reply.json()])


def _paths(value: Any, prefix: str = "", *, answered: bool = False) -> set[str]:
    """The key paths of a JSON value (lists merged as `[]`), `nts` objects left out;
    `answered`: only those with a value that is not null."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "nts" or (answered and inner is None):
                continue
            path = f"{prefix}.{key}" if prefix else key
            found.add(path)
            if not key.endswith(("logprobs", "schema", "permission")):
                found |= _paths(inner, path, answered=answered)
    elif isinstance(value, list):
        for item in value:
            found |= _paths(item, f"{prefix}[]", answered=answered)
    return found


def _texts(answer: Answer) -> list[str]:
    texts: dict[int, str] = {}
    for body in answer.bodies:
        for choice in body.get("choices", []):
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("message") or choice.get("delta") or {}).get("content")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


def _differences(row: Row, ours: Answer, stock: Answer) -> list[str]:
    found = []
    if ours.status != stock.status:
        found.append(f"status {ours.status} (ours) != {stock.status} (vLLM)")
        return found
    our_paths = set().union(*map(_paths, ours.bodies))
    stock_paths = set().union(*map(_paths, stock.bodies))
    if extra := our_paths - stock_paths:
        found.append(f"keys only ours answers: {sorted(extra)}")
    if missing := stock_paths - our_paths - VLLM_ONLY:
        found.append(f"keys only vLLM answers: {sorted(missing)}")
    wants_nts = ours.status == 200 and row.nts and row.path not in NO_NTS_PATHS
    if wants_nts and "nts" not in ours.bodies[-1]:
        found.append("no nts object on ours (last chunk for a stream)")
    for name, answer in (("ours", ours), ("vLLM", stock)):
        answered = set().union(*(_paths(body, answered=True) for body in answer.bodies))
        if unanswered := set(row.reports) - answered:
            found.append(f"{name} answers no {sorted(unanswered)}")
        for body in answer.bodies if row.body_check is not None else ():
            try:
                row.body_check(body)
            except AssertionError as error:
                found.append(f"{name}: {error}")
    if ours.status == 200 and row.check is not None:
        for text in _texts(ours) + _texts(stock):
            try:
                row.check(text)
            except AssertionError as error:
                found.append(f"constraint not held: {error}")
    return found


def test_both_servers_answer_the_matrix_alike(ours: str, stock: str) -> None:
    report = {}
    for row in ROWS:
        differences = _differences(row, _ask(ours, row), _ask(stock, row))
        if differences:
            report[row.name] = differences
    assert not report, json.dumps(report, indent=1)


def test_tokenize_answers_the_same_tokens(ours: str, stock: str) -> None:
    """Both servers tokenize with the same tokenizer and chat template: every `/tokenize` row
    both answer gets the same body from both."""
    report = {}
    for row in (r for r in ROWS if r.path == "/tokenize"):
        answers = _ask(ours, row), _ask(stock, row)
        if answers[0].status == 200 and answers[0].bodies != answers[1].bodies:
            report[row.name] = [answer.bodies for answer in answers]
    assert not report, json.dumps(report, indent=1)


def test_the_known_differences_are_as_documented(ours: str, stock: str) -> None:
    statuses = {
        name: (_ask(ours, row).status, _ask(stock, row).status)
        for name, (row, _, _) in KNOWN_DIFFERENCES.items()
    }
    expected = {name: (ours_, stock_) for name, (_, ours_, stock_) in KNOWN_DIFFERENCES.items()}
    assert statuses == expected


@pytest.mark.parametrize(
    ("path", "request_model"),
    [
        ("/v1/chat/completions", VllmChatRequest),
        ("/v1/completions", VllmCompletionRequest),
        ("/tokenize", VllmTokenizeChatRequest),
        ("/tokenize", VllmTokenizeCompletionRequest),
    ],
)
def test_the_matrix_sends_every_field_of_vllms_requests(
    path: str, request_model: type[BaseModel]
) -> None:
    """A field a new vLLM adds fails here until a row sends it (and the servers compared)."""
    rows = [*ROWS, *(row for row, _, _ in KNOWN_DIFFERENCES.values())]
    sent = {key for row in rows if row.path == path and row.body for key in row.body}
    unsent = set(request_model.model_fields) - sent
    assert not unsent, f"vLLM fields no row sends: {sorted(unsent)}"
