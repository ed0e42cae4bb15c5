"""The OpenAI protocol as this server speaks it: the request models (the response bodies are
`server.response_bodies`).

Request fields follow the order of the OpenAI API reference; what this project adds is declared
once, for both requests (`_Extras`), and comes at the end of each request. Unknown fields are
ignored, as vLLM's server ignores them, but for an `nts_*` key that is not one of ours: a 400,
so that a misspelt key is an error rather than silently dropped (`server.vllm_fields`).

Each request converts itself into vLLM `SamplingParams` with one method, `to_sampling_params`.
The server runs the `n` choices of a request as `n` engine requests (choice `i` gets
`seed + i` when a seed is given, as vLLM does for its own fan-out), so each choice has its own
temperature trace; `to_sampling_params` builds the parameters of one choice.

Per-request temperature control comes as flat keys, either top-level (the `openai` client's
`extra_body`) or inside `vllm_xargs` (vLLM's convention); `nts_request_args` merges both. The
keys are named in `engine_contract.keys` (each request model has one field per `CLIENT_KEYS`);
their values are validated by the one parser of those keys, `engine_contract.request_args`, not
here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    field_validator,
    model_validator,
)
from vllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

from noisy_temp_server.engine_contract.keys import (
    CLIENT_KEYS,
    KEY_PREFIX,
    KEY_RUNTIME_NOISE_SIGMA,
    SERVER_KEYS,
)
from noisy_temp_server.server.chat_messages import ChatMessage
from noisy_temp_server.server.structured_outputs import (
    ResponseFormat,
    StructuredOutputs,
    structured_outputs_params,
)
from noisy_temp_server.server.vllm_fields import VllmChatFields, VllmFields

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "add_extra_args",
]

XargValue = str | bool | int | float | list[str | int | float]

_TOKEN_ID = re.compile(r"-?[0-9]+")
MAX_STOP_SEQUENCES = 4
"""OpenAI's limit on `stop`: up to 4 sequences."""

_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # vLLM's engine protocol carries seeds as int64


def add_extra_args(params: SamplingParams, extra_args: dict[str, Any]) -> None:
    """Merge the server-set flat keys `extra_args` into `params.extra_args` (in place; they win
    over the client's passthrough `vllm_xargs`)."""
    params.extra_args = {**(params.extra_args or {}), **extra_args}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`; keys it does not define are ignored, as vLLM's server ignores
    them."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False
    """With `include_usage`, every chunk also reports its choice's usage so far (vLLM's). Null
    means false for both, as vLLM's `should_include_usage` reads them."""


class _Extras(VllmFields):
    """What noisy-temp-server and vLLM add to both requests, declared once: the `nts_*` keys
    (one field per `engine_contract.keys.CLIENT_KEYS`; tests/unit/test_request_keys.py holds
    it), vLLM's `ignore_eos`, `repetition_penalty`, `min_tokens`, `response_format` (OpenAI's
    on chat, vLLM's on completions), `structured_outputs` (`server.structured_outputs`),
    `vllm_xargs` and the rest of vLLM's shared fields (`server.vllm_fields`). Each request
    model lists this class first among its bases, so that these fields come after OpenAI's
    (pydantic orders the fields of the farthest base first)."""

    ignore_eos: StrictBool = False
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    nts_tune: bool | None = None
    nts_rule: str | None = None
    nts_t: float | None = None
    nts_t_min: float | None = None
    nts_t_max: float | None = None
    nts_trace: bool | None = None
    nts_bias: bool | None = None
    nts_adapter: StrictBool | str | None = None
    vllm_xargs: dict[str, XargValue] | None = None

    def nts_request_args(self) -> dict[str, Any]:
        """The flat `nts_*` keys the client gave, top-level and in `vllm_xargs` merged.

        Raises ValueError when a key comes both ways with different values, or when the client
        sets a key reserved for the server.
        """
        merged: dict[str, Any] = {
            key: getattr(self, key) for key in CLIENT_KEYS if getattr(self, key) is not None
        }
        for key, value in (self.vllm_xargs or {}).items():
            if key in SERVER_KEYS:
                raise ValueError(f"vllm_xargs.{key} is set by the server; remove it.")
            if not key.startswith(KEY_PREFIX):
                continue
            if key in merged and merged[key] != value:
                raise ValueError(
                    f"{key} is given twice with different values ({merged[key]!r} top-level, "
                    f"{value!r} in vllm_xargs); give it once."
                )
            merged[key] = value
        return merged

    @model_validator(mode="before")
    @classmethod
    def _refuse_runtime_noise(cls, data: Any) -> Any:
        xargs = data.get("vllm_xargs") if isinstance(data, dict) else None
        if isinstance(data, dict) and (
            KEY_RUNTIME_NOISE_SIGMA in data
            or (isinstance(xargs, dict) and KEY_RUNTIME_NOISE_SIGMA in xargs)
        ):
            raise ValueError(
                f"{KEY_RUNTIME_NOISE_SIGMA}: runtime noise is a server setting (serve "
                "--perturbation, NTS_PERTURBATION), not a request key; remove it."
            )
        return data


class _SamplingFields(_Request):
    """What completions and chat requests share, and their conversion to `SamplingParams`."""

    if TYPE_CHECKING:  # declared by the subclasses, in OpenAI's order
        n: int
        seed: int | None
        stop: str | list[str] | None
        stream: bool
        stream_options: StreamOptions | None
        temperature: float | None
        top_p: float | None
        frequency_penalty: float
        presence_penalty: float
        logit_bias: dict[str, float] | None
        ignore_eos: bool
        repetition_penalty: float | None
        min_tokens: int
        response_format: ResponseFormat | None
        structured_outputs: StructuredOutputs | None
        vllm_xargs: dict[str, XargValue] | None
        prompt_logprobs: int | None
        echo: bool
        logprob_token_ids: list[int] | None
        use_beam_search: bool
        watermarking: bool | None
        length_penalty: float
        include_stop_str_in_output: bool
        skip_special_tokens: bool

        def sampling_kwargs(self) -> dict[str, Any]: ...
        def logprob_kwargs(self, logprobs: int | None) -> dict[str, Any]: ...
        def transfer_extra_args(self) -> dict[str, Any]: ...

    def requested_max_tokens(self) -> int | None:
        """The client's cap on generated tokens per choice (None: up to the context length)."""
        raise NotImplementedError

    def requested_logprobs(self) -> int | None:
        """Top alternatives per token to return (None: no logprobs)."""
        raise NotImplementedError

    def requested_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token to return (None: no prompt logprobs): vLLM's
        `prompt_logprobs`, else with `echo` as many as the generated tokens get (vLLM's rule)."""
        if self.prompt_logprobs is not None or not self.echo:
            return self.prompt_logprobs
        return self.requested_logprobs()

    def to_sampling_params(self, *, max_tokens: int, choice: int = 0) -> SamplingParams:
        """vLLM parameters for choice `choice` of this request (n = 1 per engine request).

        `max_tokens`: the resolved cap (the server fills in the context-length default and
        checks the total). `extra_args` holds the client's non-`nts_*` `vllm_xargs`; the server
        adds its flat keys (policy snapshot, trace id) with `add_extra_args` once it knows the
        temperature vLLM settled on (`SamplingParams.temperature`: 0 < T < 0.01 is raised to
        0.01). Streaming requests get DELTA outputs, others FINAL_ONLY. A beam search's are
        greedy, as its steps are (`server.beam_search`). Raises vLLM's validation error for
        values vLLM refuses.
        """
        passthrough = {
            key: value
            for key, value in (self.vllm_xargs or {}).items()
            if not key.startswith(KEY_PREFIX)
        } | self.transfer_extra_args()
        logprobs = self.requested_logprobs()
        return SamplingParams.from_optional(
            n=1,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self._sampled_temperature(),
            top_p=self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            **self.logprob_kwargs(logprobs),
            prompt_logprobs=self.requested_prompt_logprobs(),
            logit_bias=None
            if self.logit_bias is None
            else {int(token): bias for token, bias in self.logit_bias.items()},
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.constraint(),
            extra_args=passthrough,
            **self.sampling_kwargs(),
        )

    def _sampled_temperature(self) -> float:
        if self.use_beam_search:
            return 0.0
        return 1.0 if self.temperature is None else self.temperature

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """vLLM's `BeamSearchParams` for `use_beam_search` (`n` beams), as its
        `to_beam_search_params` makes them but with temperature 0: each step of the search is a
        greedy one-token engine request, so that the logprobs it ranks beams by are the served
        model's own, not reshaped by a temperature or T* (`server.beam_search`)."""
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=0.0,
            watermarking=self.watermarking,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output the engine enforces (None: none)."""
        return structured_outputs_params(self.structured_outputs, self.response_format)

    @field_validator("stop", check_fields=False)
    @classmethod
    def _at_most_four_stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(
                f"stop takes up to {MAX_STOP_SEQUENCES} sequences (as OpenAI), got {len(stop)}."
            )
        return stop

    @model_validator(mode="after")
    def _check_shared(self) -> _SamplingFields:
        # vLLM refuses non-empty `stream_options` without `stream` (null and `{}` pass)
        options_sent = self.stream_options is not None and self.stream_options.model_fields_set
        if options_sent and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        if self.logit_bias is not None:
            for token in self.logit_bias:
                if not _TOKEN_ID.fullmatch(token):
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}.")
        if self.seed is not None:
            largest = _SEED_MAX - (self.n - 1)
            if not _SEED_MIN <= self.seed <= largest:
                raise ValueError(
                    f"seed must be between {_SEED_MIN} and {largest} (a 64-bit integer; choice "
                    f"i of n = {self.n} uses seed + i), got {self.seed}."
                )
        structured_outputs_params(self.structured_outputs, self.response_format)  # checked early
        if self.use_beam_search and self.logprob_token_ids:
            raise ValueError("`logprob_token_ids` is not supported with beam search.")
        if self.logprob_token_ids and self.requested_logprobs() is None:
            raise ValueError(
                "when using `logprob_token_ids`, `logprobs` must be set (true on chat)."
            )
        return self


class _CompletionFields(_SamplingFields):
    """OpenAI's fields of `CompletionRequest`, in the order of its API reference."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(default=None, ge=1)
    echo: StrictBool = False
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=0)
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None

    def requested_max_tokens(self) -> int | None:
        """`max_tokens`; 1 for an echo without generation (`max_tokens: 0`): the engine
        generates one token, which the response leaves out, as vLLM's server does."""
        return 1 if self.echoes_prompt_only else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echoes_prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the response is the prompt alone."""
        return self.echo and self.max_tokens == 0

    def prompts_text_or_ids(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids: one, or the list a batch sends (each of them
        gets `n` choices, as in vLLM's server)."""
        prompt: Any = self.prompt  # one of the four forms its type lists
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        return [p if isinstance(p, str) else list(p) for p in prompt]

    @model_validator(mode="after")
    def _check_completion(self) -> _CompletionFields:
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt must not be empty.")
            if any(isinstance(p, list) and not p for p in self.prompt):
                raise ValueError("prompt must not be empty.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported; leave it unset or equal to n.")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt alone).")
        if self.logprob_token_ids and self.echoes_prompt_only:
            raise ValueError(
                "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
                "no output tokens are generated."
            )
        if self.use_beam_search and self.stream:  # vLLM's chat streams a beam search, not this
            raise ValueError("Streaming is not currently supported with beam search.")
        if self.use_beam_search and self.echo and self.logprobs is not None:
            raise ValueError(
                "`echo` with `logprobs` is not supported with beam search because beam search "
                "does not compute prompt logprobs."
            )
        if self.suffix is not None:  # vLLM's server: only for models with FIM rendering
            raise ValueError(
                "suffix is only supported for models with FIM completion rendering; this server "
                "renders none: leave it unset."
            )
        return self


class _CompletionExtras(_Extras):
    """vLLM's fields of its completions request only."""

    add_special_tokens: StrictBool = True


class CompletionRequest(_CompletionExtras, _CompletionFields):
    """`POST /v1/completions` (https://platform.openai.com/docs/api-reference/completions)."""


class _ChatFields(_SamplingFields):
    """OpenAI's fields of `ChatCompletionRequest`, in the order of its API reference."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: StrictBool = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def requested_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs or 0  # vLLM's chat: with echo, always
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _check_chat(self) -> _ChatFields:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true.")
        for message in self.messages:
            message.text()
        return self


class _ChatExtras(_Extras, VllmChatFields):
    """vLLM's chat-only fields (`server.vllm_fields`) and the tool constraint on them."""

    _tool_constraint: StructuredOutputsParams | None = PrivateAttr(default=None)

    def constrain(self, constraint: StructuredOutputsParams | None) -> None:
        """Replace the request's structured output by `constraint` (`server.tools`: vLLM's
        parser constrains `required` and named tool choices)."""
        self._tool_constraint = constraint

    def constraint(self) -> StructuredOutputsParams | None:
        if self._tool_constraint is not None:
            return self._tool_constraint
        return structured_outputs_params(self.structured_outputs, self.response_format)

    def vllm_fields(self) -> dict[str, Any]:
        """The body as the client sent it, for vLLM's own request model (without the keys
        only this server takes)."""
        ours = {*CLIENT_KEYS, "vllm_xargs"}
        return self.model_dump(by_alias=True, exclude_unset=True, exclude=ours)


class ChatCompletionRequest(_ChatExtras, _ChatFields):
    """`POST /v1/chat/completions` (https://platform.openai.com/docs/api-reference/chat)."""
