"""Protocol models: validation and conversion to vLLM SamplingParams."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.renderers.chat_utils import _parse_chat_message_content, _postprocess_messages
from vllm.sampling_params import RequestOutputKind

from noisy_temp_server.server.chat_messages import ContentFormat, template_messages
from noisy_temp_server.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    add_extra_args,
)
from noisy_temp_server.server.response_bodies import CompletionResponse, NtsSummary


def _completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_completion_fields_follow_the_openai_reference_order() -> None:
    names = list(CompletionRequest.model_fields)
    assert names[:4] == ["model", "prompt", "best_of", "echo"]
    assert names.index("temperature") < names.index("top_p") < names.index("user")
    assert names.index("user") < names.index("nts_tune") < names.index("vllm_xargs")


def test_completion_converts_sampling_fields() -> None:
    request = _completion(
        temperature=0.7,
        top_p=0.9,
        stop=["\n"],
        seed=11,
        logprobs=3,
        presence_penalty=0.5,
        logit_bias={"5": -100},
        n=3,
    )
    params = request.to_sampling_params(max_tokens=9, choice=2)
    add_extra_args(params, {"nts_trace_id": "x"})
    assert params.n == 1
    assert params.temperature == pytest.approx(0.7)
    assert params.top_p == pytest.approx(0.9)
    assert params.stop == ["\n"]
    assert params.seed == 13  # seed + choice
    assert params.logprobs == 3
    assert params.max_tokens == 9
    assert params.presence_penalty == pytest.approx(0.5)
    assert params.logit_bias == {5: -100}
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    assert params.extra_args == {"nts_trace_id": "x"}


def test_streaming_requests_get_delta_outputs() -> None:
    request = _completion(stream=True, stream_options={"include_usage": True})
    params = request.to_sampling_params(max_tokens=4)
    assert params.output_kind == RequestOutputKind.DELTA


def test_default_temperature_is_one_and_unseeded_choices_stay_unseeded() -> None:
    params = _completion().to_sampling_params(max_tokens=4, choice=1)
    assert params.temperature == 1.0
    assert params.seed is None


def test_chat_logprobs_map_to_top_logprobs_count() -> None:
    assert _chat().requested_logprobs() is None
    assert _chat(logprobs=True).requested_logprobs() == 0
    assert _chat(logprobs=True, top_logprobs=4).requested_logprobs() == 4
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        _chat(top_logprobs=4)


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    assert _chat(max_tokens=5).requested_max_tokens() == 5
    assert _chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens() == 7
    assert _chat().requested_max_tokens() is None


def test_chat_text_parts_are_joined_and_other_parts_refused() -> None:
    request = _chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert [m.template_message() for m in request.messages] == [{"role": "user", "content": "a\nb"}]
    with pytest.raises(ValidationError, match="only text content parts"):
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_an_assistants_reasoning_reaches_the_template_under_both_names() -> None:
    """vLLM's renderer: `reasoning_content` is the old name of `reasoning`; the template gets
    both, for an assistant's message only."""
    request = _chat(
        messages=[
            {"role": "user", "content": "q", "reasoning": "no"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ]
    )
    user, assistant = (m.template_message() for m in request.messages)
    assert user == {"role": "user", "content": "q"}
    assert assistant == {"role": "assistant", "content": "a", "reasoning": "r",
                         "reasoning_content": "r"}  # fmt: skip


_MESSAGES_WITH_EXTRA_KEYS: list[dict[str, Any]] = [
    {"role": "system", "content": "x-anthropic-billing-header: cch=1\nbe brief", "name": "s",
     "custom": 1},
    {"role": "developer", "content": "d", "tool_call_id": "no"},
    {"role": "user", "content": [{"type": "text", "text": "q"}] * 2, "name": "ann", "task": "t",
     "tool_call_id": "no", "reasoning": "no", "tools": []},
    {"role": "assistant", "content": None, "reasoning_content": "r", "tool_call_id": "no",
     "tool_calls": [{"id": "c", "type": "function",
                     "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    {"role": "assistant", "content": "ok", "tool_calls": [], "name": "bot"},
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "x"}] * 2,
     "name": "f", "tool_calls": []},
]  # fmt: skip


class _TextOnlyTracker:
    """What vLLM's message parser asks of its multimodal tracker for text-only messages."""

    def create_parser(self, **_: Any) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(enable_prompt_embeds=False),
            mm_placeholder_storage=dict,
        )


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_messages_reach_the_template_with_the_keys_vllms_renderer_passes(
    content_format: ContentFormat,
) -> None:
    """Compared with vLLM's own parsing (`_parse_chat_message_content`, then
    `_postprocess_messages`) of the same body: only the keys vLLM passes, tool-call arguments
    as objects, an empty `tool_calls` dropped, the billing-header line of a system message
    stripped."""
    vllm_request = VllmChatRequest(messages=_MESSAGES_WITH_EXTRA_KEYS, model="m")  # type: ignore[arg-type]
    theirs: list[Any] = []
    for message in vllm_request.messages:
        theirs += _parse_chat_message_content(
            message,
            _TextOnlyTracker(),
            content_format,
            interleave_strings=False,  # type: ignore[arg-type]
        )
    _postprocess_messages(theirs)
    request = _chat(messages=_MESSAGES_WITH_EXTRA_KEYS)
    assert template_messages(request.messages, content_format) == theirs
    assert request.messages[3].model_extra["tool_calls"][0]["function"]["arguments"] == (
        '{"a": 1}'  # the request's own message is left as sent
    )


def test_nts_keys_merge_from_top_level_and_vllm_xargs() -> None:
    request = _completion(nts_rule="fixed", vllm_xargs={"nts_t": 1.5, "other": 1})
    assert request.nts_request_args() == {"nts_rule": "fixed", "nts_t": 1.5}
    params = request.to_sampling_params(max_tokens=2)
    assert params.extra_args == {"other": 1}
    add_extra_args(params, {"nts_policy": "{}", "other": 2})
    assert params.extra_args == {"other": 2, "nts_policy": "{}"}


def test_nts_key_given_twice_differently_is_refused() -> None:
    request = _completion(nts_t=1.2, vllm_xargs={"nts_t": 1.5})
    with pytest.raises(ValueError, match="given twice"):
        request.nts_request_args()


def test_server_keys_cannot_come_from_the_client() -> None:
    with pytest.raises(ValueError, match="set by the server"):
        _completion(vllm_xargs={"nts_policy": "{}"}).nts_request_args()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nts_tmax": 1}, "not a request key of this server"),
        ({"temperature": -1}, "greater than or equal"),
        ({"n": 0}, "greater than or equal"),
        ({"stream_options": {"include_usage": True}}, "only allowed when stream"),
        ({"max_tokens": 0}, "0 only with echo"),
        ({"prompt": [[1], []]}, "must not be empty"),
        ({"suffix": ""}, "FIM completion rendering"),
        ({"min_tokens": -1}, "greater than or equal"),
        ({"response_format": {"type": "json_schema"}}, "'json_schema' field must be"),
        ({"response_format": {"type": "xml"}}, "json_schema"),
        ({"structured_outputs": {}}, "none are specified"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "multiple are specified"),
        ({"structured_outputs": {"bogus": 1}}, "Extra inputs"),
        (  # response_format adds its constraint to structured_outputs', as in vLLM's server
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "multiple are specified",
        ),
        ({"logit_bias": {"x": 1}}, "token ids"),
    ],
)
def test_invalid_completion_requests_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _completion(**fields)


def test_prompt_forms() -> None:
    assert _completion(prompt="one").prompts_text_or_ids() == ["one"]
    assert _completion(prompt=["a", "b"]).prompts_text_or_ids() == ["a", "b"]
    assert _completion(prompt=[1, 2, 3]).prompts_text_or_ids() == [[1, 2, 3]]
    assert _completion(prompt=[[1], [2, 3]]).prompts_text_or_ids() == [[1], [2, 3]]


def test_min_tokens_reaches_the_engine() -> None:
    assert _completion(min_tokens=3).to_sampling_params(max_tokens=4).min_tokens == 3
    assert _completion().to_sampling_params(max_tokens=4).min_tokens == 0


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}},
                }
            },
            {"json": {}},
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'}),
        ({"structured_outputs": {"json": {"type": "object"}}}, {"json": {"type": "object"}}),
    ],
)
def test_structured_outputs_reach_the_engine(
    fields: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    for request in (_completion(**fields), _chat(**fields)):
        params = request.to_sampling_params(max_tokens=4).structured_outputs
        if expected is None:
            assert params is None
            continue
        assert params is not None
        assert {k: getattr(params, k) for k in expected} == expected


def test_response_serialises_with_nts_extension() -> None:
    summary = NtsSummary(rule="fixed", policy_version=3, t_mean=1.5, t_min=1.5, t_max=1.5, steps=2)
    response = CompletionResponse(id="cmpl-1", model="m", choices=[], nts=summary)
    body = response.model_dump(mode="json")
    assert body["object"] == "text_completion"
    assert body["nts"]["rule"] == "fixed"
    assert body["nts"]["trace"] is None


def test_repetition_penalty_reaches_the_engine() -> None:
    """vLLM's extension; `vllm bench serve --backend openai` sends it (1.0) on every request."""
    assert (
        _completion(repetition_penalty=1.3).to_sampling_params(max_tokens=4).repetition_penalty
        == 1.3
    )
    assert _completion().to_sampling_params(max_tokens=4).repetition_penalty == 1.0
    with pytest.raises(ValidationError, match="greater than 0"):
        _completion(repetition_penalty=0)
