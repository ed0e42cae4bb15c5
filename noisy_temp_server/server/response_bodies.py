"""The OpenAI protocol's response bodies as this server sends them (requests:
`server.protocol`). Unknown fields are refused here too, so a response never carries a field
by mistake; the `nts` objects are this project's extension.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer
from vllm.entrypoints.generate.base.protocol import DeltaToolCall, ToolCall
from vllm.entrypoints.generate.base.serving import format_token_id_placeholder

if TYPE_CHECKING:
    from vllm.logprobs import PromptLogprobs as VllmPromptLogprobs

__all__ = [
    "MIN_LOGPROB",
    "ChatChunkChoice",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionLogprobs",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionResponse",
    "CompletionStreamResponse",
    "CompletionTokensDetails",
    "LogprobTokens",
    "ModelCard",
    "ModelList",
    "NtsSummary",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptTokensDetails",
    "TopLogprob",
    "Usage",
    "clean_logprob",
    "prompt_logprobs_body",
]


MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM's server uses the same floor


def clean_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN become vLLM's floor of -9999."""
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


@dataclass(frozen=True)
class LogprobTokens:
    """How a response's logprobs name their tokens and which candidates they list, as vLLM's
    server: `as_ids` (`return_tokens_as_token_ids`) names each token `token_id:<id>` instead of
    its text; `every_candidate` (`logprob_token_ids`) lists every candidate the engine returned
    (the sampled token and the ids asked for) instead of the `top` best."""

    top: int = 0
    as_ids: bool = False
    every_candidate: bool = False

    def name(self, token_id: int, text: str | None) -> str | None:
        """The token's name: `token_id:<id>`, else its text (None: the engine gave none)."""
        return format_token_id_placeholder(token_id) if self.as_ids else text


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NtsSummary(_Response):
    """The `nts` extension object: what temperature the request was served at.

    `t_mean`, `t_min`, `t_max` summarise T* over the generation steps (T* only: the effective
    temperature is the request's own temperature times T*). Greedy and tuning-off requests
    report T* = 1. `trace` (per step) only when the request asked with `nts_trace`. The T
    statistics are null when the engine's trace did not arrive (then `steps` still counts the
    generated tokens). `bias`: the sha256 of the per-token logit bias added to the served
    logits before the temperature (null: none). Unlike a temperature, the bias changes greedy
    output and the returned logprobs (greedy requests get it too, unless `nts_bias` is false).
    `adapter`: the sha256 of the compensation adapter the served weights were corrected by
    (null: none; `server.adapter`).
    """

    rule: str
    policy_version: int
    alpha: float | None = None
    t_mean: float | None
    t_min: float | None
    t_max: float | None
    steps: int
    trace: list[float] | None = None
    bias: str | None = None
    adapter: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One candidate of a prompt position in vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt token its candidates (null at position 0)."""


def prompt_logprobs_body(positions: VllmPromptLogprobs | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs as vLLM's server answers them (-inf: its floor)."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(token): PromptLogprob(
                logprob=clean_logprob(c.logprob), rank=c.rank, decoded_token=c.decoded_token
            )
            for token, c in position.items()
        }
        for position in positions
    ]


class _OmitWhenEmpty(_Response):
    """A body whose keys named in `_omitted_when_empty` are left out when empty or null, and
    those in `_omitted_when_null` when null, as vLLM leaves them out (or as a key only some of
    vLLM's bodies carry: the token ids and prompt text a request asks for)."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ()
    _omitted_when_null: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in self._omitted_when_empty:
            if not data.get(key):
                data.pop(key, None)
        for key in self._omitted_when_null:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class PromptTokensDetails(_Response):
    """What `usage` details of the prompt (``--enable-prompt-tokens-details``): the tokens the
    engine found in its prefix cache."""

    cached_tokens: int


class CompletionTokensDetails(_Response):
    """What `usage` details of the completion (with ``--reasoning-parser``, as vLLM's): the
    generated tokens inside the reasoning, by the parser's count."""

    reasoning_tokens: int


class Usage(_OmitWhenEmpty):
    _omitted_when_null = ("prompt_tokens_details", "completion_tokens_details")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionChoice(_OmitWhenEmpty):
    _omitted_when_empty = ("prompt_logprobs",)
    _omitted_when_null = ("prompt_token_ids", "token_ids")

    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    nts: NtsSummary | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    nts: NtsSummary | None = None


class CompletionStreamResponse(CompletionResponse):
    """A streamed completion chunk (same object name as the full response, as OpenAI does)."""


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_OmitWhenEmpty):
    """The answer's message; `role`: ``--response-role`` (`assistant`) when the request opens
    that turn (`add_generation_prompt`), else the last message's (vLLM's); `reasoning`: what
    ``--reasoning-parser`` split out of the text (null without, as vLLM's)."""

    _omitted_when_empty = ("tool_calls",)

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_OmitWhenEmpty):
    _omitted_when_null = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    nts: NtsSummary | None = None


class ChatCompletionResponse(_OmitWhenEmpty):
    _omitted_when_empty = ("prompt_logprobs",)
    _omitted_when_null = ("prompt_token_ids", "prompt_text")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    nts: NtsSummary | None = None


class ChatDelta(_OmitWhenEmpty):
    """What a stream chunk adds to a choice; `reasoning` (only in the chunks that add some):
    what ``--reasoning-parser`` splits out of the text, as vLLM's."""

    _omitted_when_empty = ("tool_calls",)
    _omitted_when_null = ("reasoning",)

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatChunkChoice(_OmitWhenEmpty):
    _omitted_when_null = ("token_ids",)

    index: int
    delta: ChatDelta
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    nts: NtsSummary | None = None


class ChatCompletionChunk(_OmitWhenEmpty):
    _omitted_when_null = ("prompt_token_ids", "prompt_text")

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    nts: NtsSummary | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "noisy-temp-server"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
