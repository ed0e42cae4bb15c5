"""vLLM's own fields of the two generation requests (the `ChatCompletionRequest` and
`CompletionRequest` of vLLM's OpenAI server), taken with vLLM's meaning.

`VllmFields` declares, with vLLM's types and defaults, the fields both requests share:

- sampling: `sampling_kwargs` hands them to `SamplingParams` exactly as vLLM's
  `to_sampling_params` does, so vLLM validates the values and the engine applies them
  (`top_k`, `min_p`, `stop_token_ids`, `bad_words`, `allowed_token_ids`, ...);
- the prompt: `truncate_prompt_tokens` / `truncation_side` (`truncate_prompts`, vLLM's own
  `TokenizeParams`);
- the engine request: `priority`, `cache_salt` (`engine_kwargs`, `prompt_kwargs`), and
  `kv_transfer_params` / `ec_transfer_params`, passed in `extra_args` as vLLM passes them;
- `prompt_logprobs`: the prompt's logprobs (the served model's own: vLLM computes them before
  any logits processor), in the response as vLLM puts them;
- `request_id` names the response (`cmpl-<request_id>`, `chatcmpl-<request_id>`) as on vLLM's
  server, unless an ``X-Request-Id`` header names it (`server.serving.prepare_request`); the
  engine requests keep ids of this server's own (one per choice, unique);
- what the response reports, as vLLM's server reports it: `return_token_ids` (the prompt's and
  each choice's token ids), `return_tokens_as_token_ids` (logprob tokens named
  `token_id:<id>`), `logprob_token_ids` (the logprobs of these ids at each generated position,
  with the sampled token's, instead of the top candidates: `logprob_kwargs`); they change
  nothing the engine samples, so T*, the bias and the shadow scorer's capture are untouched;
- `use_beam_search` with `length_penalty`: vLLM's own beam search (`server.beam_search`);
- fields vLLM's server reads only on other endpoints or with features this server never starts
  with (`session_id`, `return_token_offsets`, `mm_payload`, `return_mm_kwargs`): taken, no
  effect, as on vLLM's server.

`VllmChatFields` adds vLLM's chat-only fields: the chat template's arguments
(`ChatTemplateFields`, which `/tokenize`'s chat form takes too), `echo`, `tools`, `tool_choice`
and `include_reasoning` (`server.tools`), `return_prompt_text` (the rendered prompt in the
response).

`NOT_TAKEN` lists vLLM's fields this server refuses, each with why; a request sending one gets
a 400 saying why. tests/unit/test_vllm_fields.py checks that every field of vLLM's two request
models is a field of ours or listed there, so a field a new vLLM adds fails that test until it
is taken or listed.

Any other field a request does not define is ignored, as vLLM's server ignores it (logged at
debug level), but for an `nts_*` key that is not one of ours: a 400 naming it, since a misspelt
key of ours (`nts_rul`) must not be silently dropped (vLLM defines no `nts_*` field). The
nested objects (`stream_options`, `response_format`, `structured_outputs`) still refuse keys
they do not define: they are small and a misspelt key there changes the answer silently.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from vllm.entrypoints.generate.base.protocol import (
    validate_cache_salt,
    validate_request_mm_kwargs,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
)
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.renderers import TokenizeParams, merge_kwargs
from vllm.sampling_params import RepetitionDetectionParams, ThinkingTokenBudget

from noisy_temp_server.engine_contract.keys import CLIENT_KEYS, KEY_PREFIX
from noisy_temp_server.server.errors import OpenAIError, openai_error_from_exception

__all__ = ["NOT_TAKEN", "ChatTemplateFields", "VllmChatFields", "VllmFields"]

_LOGGER = logging.getLogger(__name__)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

NOT_TAKEN: dict[str, str] = {
    "prompt_embeds": "prompts are text or token ids (vLLM too refuses them unless started "
    "with --enable-prompt-embeds)",
}
"""vLLM's request fields this server refuses (400), each with why (docs/serving.md)."""


def _refusal(key: str) -> PydanticCustomError:
    """Why an unknown field `key` is refused: vLLM's, refused on purpose, or a key of ours
    misspelt."""
    if key in NOT_TAKEN:
        return PydanticCustomError(
            "not_taken", "not supported by this server: {why}", {"why": NOT_TAKEN[key]}
        )
    return PydanticCustomError(
        "unknown_nts_key",
        "not a request key of this server (they are {keys}); a misspelt key is not ignored",
        {"keys": ", ".join(sorted(CLIENT_KEYS))},
    )


_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The sampling fields a model's generation config gives defaults for (vLLM's server)."""


class VllmFields(BaseModel):
    """vLLM's extension fields that both generation requests share, and vLLM's way with the
    fields a request does not define (module docstring)."""

    model_config = ConfigDict(extra="ignore")

    use_beam_search: StrictBool = False
    top_k: int | None = None
    min_p: float | None = None
    watermarking: StrictBool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str | None = None
    session_id: str | None = None
    return_token_offsets: StrictBool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: StrictBool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    thinking_token_budget: ThinkingTokenBudget = None
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    return_token_ids: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields_as_vllm(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = sorted(set(data) - set(cls.model_fields))
        refused = [
            InitErrorDetails(type=_refusal(key), loc=(key,), input=data[key])
            for key in unknown
            if key in NOT_TAKEN or key.startswith(KEY_PREFIX)
        ]
        if refused:  # each error at its key, so that the error body names it (`param`)
            raise ValidationError.from_exception_data(cls.__name__, refused)
        if unknown:
            _LOGGER.debug("The request's fields %s are not fields of it: ignored", unknown)
        return data

    @model_validator(mode="after")
    def _prompt_logprobs_as_vllm(self) -> Self:
        stream = getattr(self, "stream", False)
        if self.prompt_logprobs is not None:
            if stream and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
                raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
            if self.prompt_logprobs < 0 and self.prompt_logprobs != -1:
                raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        return self

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_as_vllm(cls, value: str | None) -> str | None:
        validate_cache_salt(value)
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _vllm_refusals_are_validation_errors(
        cls, data: Any, handler: ModelWrapValidatorHandler[Self]
    ) -> Self:
        """vLLM's own checks (`cache_salt`, `repetition_detection`, `thinking_token_budget`)
        raise `VLLMValidationError`; a 400 with vLLM's message, as on vLLM's server."""
        try:
            return handler(data)
        except VLLMValidationError as error:
            raise ValueError(str(error)) from None

    def with_sampling_defaults(self, defaults: Mapping[str, Any]) -> Self:
        """This request with the fields it leaves unset that ``defaults`` names (the model's
        generation config, `ServerState.sampling_defaults`) taken from them, as vLLM's
        `to_sampling_params` takes them: `temperature`, `top_p`, `top_k`, `min_p`,
        `repetition_penalty`."""
        update = {
            name: defaults[name]
            for name in _GENERATION_DEFAULTS
            if name in defaults and getattr(self, name) is None
        }
        return self.model_copy(update=update) if update else self

    def sampling_kwargs(self) -> dict[str, Any]:
        """These fields' `SamplingParams.from_optional` arguments, as vLLM's `to_sampling_params`
        passes them (an unset `top_k` / `min_p`: vLLM's OpenAI default, 0)."""
        return {
            "top_k": 0 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "watermarking": self.watermarking,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "repetition_detection": self.repetition_detection,
            "stream_interval": self.stream_interval,
            "thinking_token_budget": self.thinking_token_budget,
            "routed_experts_prompt_start": self.routed_experts_prompt_start,
        }

    def logprob_kwargs(self, logprobs: int | None) -> dict[str, Any]:
        """`SamplingParams`' `logprobs` and `logprob_token_ids`, as vLLM's `to_sampling_params`
        sets them: with `logprob_token_ids`, those ids instead of the `logprobs` top
        candidates (the sampled token's logprob comes with either)."""
        if self.logprob_token_ids:
            return {"logprobs": None, "logprob_token_ids": self.logprob_token_ids}
        return {"logprobs": logprobs}

    def transfer_extra_args(self) -> dict[str, Any]:
        """`kv_transfer_params` / `ec_transfer_params` under their names, for `extra_args`."""
        transfers = {
            "kv_transfer_params": self.kv_transfer_params,
            "ec_transfer_params": self.ec_transfer_params,
        }
        return {key: value for key, value in transfers.items() if value}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's `generate` (`priority` when not 0)."""
        return {"priority": self.priority} if self.priority else {}

    def prompt_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.inputs.tokens_input` (`cache_salt` when given)."""
        return {"cache_salt": self.cache_salt} if self.cache_salt is not None else {}

    def truncate_prompts(
        self, tokenizer: Any, prompts: list[list[int]], max_model_len: int, max_tokens: int | None
    ) -> list[list[int]]:
        """The token ids of each prompt truncated as vLLM truncates a prompt
        (`truncate_prompt_tokens` kept from `truncation_side`, the tokenizer's side by default;
        -1: the context length less one). Raises `OpenAIError` (400, vLLM's message) for a
        truncation longer than the context."""
        if self.truncate_prompt_tokens is None:
            return prompts
        try:
            params = TokenizeParams(
                max_total_tokens=max_model_len,
                max_output_tokens=max_tokens or 0,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                truncation_side=self.truncation_side,
            )
            truncated: list[Any] = [
                params.apply_post_tokenization(tokenizer, {"prompt_token_ids": ids})
                for ids in prompts
            ]
        except VLLMClientError as error:
            raise openai_error_from_exception(error) from None
        return [list(prompt["prompt_token_ids"]) for prompt in truncated]


class ChatTemplateFields(BaseModel):
    """What vLLM's chat request and its `/tokenize` chat request render the messages with, with
    vLLM's meaning (`template_kwargs`): the assistant's turn opened (`add_generation_prompt`,
    by default) or the last message continued (`continue_final_message`; both true is vLLM's
    400), `chat_template_kwargs`, `tools`, special tokens added on top of the template's
    (`add_special_tokens`, off by default). Refused as vLLM's server refuses them (a 400 with
    its message): a `chat_template` in the request without ``--trust-request-chat-template``
    (`own_chat_template`) and non-empty `media_io_kwargs` / `mm_processor_kwargs` (vLLM takes
    them only with ``--trust-request-mm-kwargs``, which `serve` does not take)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None

    def own_template_kwargs(self) -> dict[str, Any]:
        """The request's own fields that are template arguments (over `chat_template_kwargs`)."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def template_kwargs(
        self, defaults: Mapping[str, Any] | None = None, *, exclude_tools_when_none: bool = False
    ) -> dict[str, Any]:
        """The chat template's keyword arguments, merged as vLLM's `build_chat_params` and
        `with_defaults` merge them (`defaults`, ``--default-chat-template-kwargs``, under
        `chat_template_kwargs`, under the request's own fields), with `tools` as the template
        takes them when the request has some (`renders_tools`)."""
        requested = merge_kwargs(self.chat_template_kwargs, self.own_template_kwargs())
        kwargs = merge_kwargs(dict(defaults or {}), requested)
        if self.renders_tools(exclude_when_none=exclude_tools_when_none):
            kwargs["tools"] = [tool.model_dump() for tool in self.tools or ()]
        return kwargs

    def renders_tools(self, *, exclude_when_none: bool) -> bool:
        """Whether the template gets the request's tools: whenever it has some."""
        return self.tools is not None

    def own_chat_template(self, *, trusted: bool) -> str | None:
        """The request's own chat template (None: the server's). Raises `OpenAIError`, a 400
        with vLLM's message, when it sends one (as `chat_template` or in
        `chat_template_kwargs`) and is not `trusted` (``--trust-request-chat-template``)."""
        sent = (self.chat_template_kwargs or {}).get("chat_template") is not None
        if not trusted and (sent or self.chat_template is not None):
            raise OpenAIError(
                "Chat template is passed with request, but --trust-request-chat-template is not "
                "set. Refused request with untrusted chat template.",
                status_code=400,
            )
        return self.chat_template

    @model_validator(mode="after")
    def _check_template_fields(self) -> Self:
        given = self.model_fields_set
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and ("add_generation_prompt" in given)
        ):
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        try:
            validate_request_mm_kwargs(
                mm_processor_kwargs=self.mm_processor_kwargs,
                media_io_kwargs=self.media_io_kwargs,
                trust_request_mm_kwargs=False,
            )
        except VLLMValidationError as error:
            raise ValueError(str(error)) from None
        return self


class VllmChatFields(ChatTemplateFields, VllmFields):
    """vLLM's fields of its chat request only: what the chat template is rendered with
    (`ChatTemplateFields`, and `documents`, `reasoning_effort`), `echo` (the last message's
    text starts the answer when it has the answer's role), `include_reasoning` (the reasoning
    split out of the answer is left out; with ``--reasoning-parser`` only: `server.tools`), and
    `parallel_tool_calls` (`false`: only the first tool call is answered, streams included, as
    vLLM's: `server.tools`)."""

    echo: StrictBool = False
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: StrictBool = True
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = (
        "none"
    )
    parallel_tool_calls: StrictBool | None = True
    return_prompt_text: StrictBool | None = None

    def renders_tools(self, *, exclude_when_none: bool) -> bool:
        """`ChatTemplateFields`', but for a request that sets `tool_choice` to `none` when
        `exclude_when_none` (``--exclude-tools-when-tool-choice-none``, vLLM's)."""
        excluded = exclude_when_none and self.tool_choice == "none"
        return super().renders_tools(exclude_when_none=False) and not (
            excluded and "tool_choice" in self.model_fields_set
        )

    def own_template_kwargs(self) -> dict[str, Any]:
        """`ChatTemplateFields`' with `documents` and `reasoning_effort`; `enable_thinking`
        follows `reasoning_effort` unless `chat_template_kwargs` gives it (vLLM's)."""
        extra = super().own_template_kwargs() | {
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
        }
        user = self.chat_template_kwargs or {}
        if self.reasoning_effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = self.reasoning_effort != "none"
        return extra
