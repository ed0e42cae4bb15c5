"""The generation plumbing that `/v1/completions` and `/v1/chat/completions` share.

A request's path:

1. `prepare_request`: check the model name, tokenize the prompt in a worker thread, check the
   context length, make one `SamplingParams` per choice, pin the policy in force, apply the
   server defaults under the `nts_*` keys (`engine_contract.request_args`), give each choice its
   engine request and trace id, and draw the shadow scorer's samples (which run traced), all
   before the engine: a bad request costs nothing and gets an OpenAI error body;
2. `run_unless_disconnected` (JSON response) or `server.streaming.stream_choices` (server-sent
   events): run the choices on the engine, concurrently;
3. when a choice finishes, join its per-step T* (trace channel) with its output into its `nts`
   summary, feed the metrics, and submit it to the shadow scorer if sampled (never waiting).

Greedy and tuning-off requests are never touched by the processor and report T* = 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.utils.async_utils import merge_async_iterators

from noisy_temp_server.engine_contract.keys import (
    KEY_ADAPTER,
    KEY_RULE,
    KEY_T,
    KEY_T_MAX,
    KEY_T_MIN,
)
from noisy_temp_server.engine_contract.request_args import (
    GREEDY_TEMPERATURE,
    LogitCorrection,
    RequestTuning,
    TuningKeys,
    capturable,
    issue_extra_args,
    parse_request_args,
    resolve_correction,
    resolve_request,
)
from noisy_temp_server.engine_contract.trace_channel import TraceReport
from noisy_temp_server.server.adapter import (
    NO_ADAPTER,
    RequestAdapter,
    check_model,
    request_adapter,
)
from noisy_temp_server.server.beam_search import beam_search_outputs
from noisy_temp_server.server.errors import OpenAIError, openai_error_from_exception
from noisy_temp_server.server.nts_summary import choice_summary, combine_summaries
from noisy_temp_server.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    add_extra_args,
)
from noisy_temp_server.server.response_bodies import NtsSummary
from noisy_temp_server.temperature.rules import Rule

if TYPE_CHECKING:
    from vllm.logprobs import PromptLogprobs, SampleLogprobs
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import BeamSearchParams, SamplingParams

    from noisy_temp_server.server.state import ServerState
    from noisy_temp_server.settings import Settings
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "MAX_CHOICES",
    "Choice",
    "GenerationRequest",
    "Piece",
    "PreparedRequest",
    "absorb",
    "engine_streams",
    "forget_unsummarized",
    "overall_summary",
    "prepare_request",
    "run_unless_disconnected",
    "summarize",
]

_LOGGER = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer

GenerationRequest = CompletionRequest | ChatCompletionRequest

MAX_CHOICES = 1024
"""The most choices (prompts x n) one request makes engine requests for: a body of many short
prompts cannot fan out without bound."""


@dataclass
class Choice:
    """One choice's accumulated output. `shadow_sampled`: the shadow scorer sampled it at
    admission (it runs traced and is submitted for scoring when it finishes).
    `prompt_logprobs`: the served model's logprobs of the prompt tokens (None at position 0)
    when the request asked for them. `prompt`: which of the request's prompts it continues
    (a completions request may send a list; choice `prompt * n + j` is the `j`-th of prompt
    `prompt`, as in vLLM's server). `cached_tokens`: the prompt tokens the engine found in its
    prefix cache, as it reports them (None: not reported)."""

    index: int
    trace_id: str
    prompt: int = 0
    shadow_sampled: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    summary: NtsSummary | None = None
    prompt_logprobs: PromptLogprobs | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Piece:
    """What one response object reports of a choice: all of it (JSON response) or what one
    engine step added (stream chunk). `text_offset`: where `text` starts in the choice's text."""

    token_ids: Sequence[int]
    text: str
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    text_offset: int


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the engine.

    `request_id`: its response's `id` (`prepare_request`); `engine_id`: this server's own,
    unique whatever the client sent (its choices' trace ids, its beam search's engine requests
    and its shadow scorer's cluster derive from it); `prompts`: the token ids of each of its
    prompts (one, but for a completions request that sends a list); `keys`: its `nts_*` keys
    over the server defaults, with `policy` pinned; `tuning`: what the processor will apply to
    it (None when not tuned: no trace records come); `correction`: the per-token bias its
    logits get (None: none); `adapter`: the compensation adapter it is served with
    (`server.adapter`); `model`: the model id its response names (the one it asked for: the
    base model id is served without the adapter);
    `prompt_kwargs`, `engine_kwargs`: vLLM's fields for the engine (`server.vllm_fields`);
    `beam`: a beam search's parameters (None: no beam search; `server.beam_search`).
    """

    request_id: str
    engine_id: str
    prompts: list[list[int]]
    keys: TuningKeys
    policy: TemperaturePolicy
    tuning: RequestTuning | None
    choices: list[Choice]
    params: list[SamplingParams]
    correction: LogitCorrection | None = None
    adapter: RequestAdapter = NO_ADAPTER
    model: str = ""
    prompt_kwargs: Mapping[str, Any] = field(default_factory=dict)
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    beam: BeamSearchParams | None = None

    def prompt_of(self, choice: Choice) -> list[int]:
        """The token ids of the prompt `choice` continues."""
        return self.prompts[choice.prompt]


# ----------------------------------------------------------------------------- admission


async def prepare_request(
    state: ServerState,
    request: GenerationRequest,
    tokenize: Callable[[], list[list[int]]],
    *,
    prefix: str,
    param: str,
    header_id: str | None = None,
) -> PreparedRequest:
    """Validate `request` and make its engine requests; raises `OpenAIError` for anything the
    engine would refuse. The model name is checked first; then `tokenize()` (the token ids of
    each prompt, truncated as asked; it may raise `OpenAIError`) runs in a worker thread, so a
    long prompt does not stall the event loop. Each prompt gets `n` choices (`Choice.prompt`).
    The response's id is vLLM's (`_base_request_id`): `prefix-` and the ``X-Request-Id`` header
    `header_id` when sent, else the client's `request_id` when sent, else the engine id (new,
    `prefix-` and a uuid). `param` names the prompt's field in error bodies. Raised
    before anything reaches the engine, a `ValueError`, `TypeError` or `OverflowError` comes
    from the request's values (a tokenizer refusing a prompt, vLLM's checks, ours): a 400 with
    its message, as on vLLM's server; vLLM's client errors get theirs."""
    try:
        engine_id = f"{prefix}-{uuid.uuid4().hex}"
        base = request.request_id if header_id is None else header_id
        ids = (engine_id if base is None else f"{prefix}-{base}", engine_id)
        return await _prepare(state, request, tokenize, request_ids=ids, param=param)
    except (ValueError, TypeError, OverflowError) as error:
        raise OpenAIError(str(error) or type(error).__name__, status_code=400) from None
    except VLLMClientError as error:
        raise openai_error_from_exception(error) from None


async def _prepare(
    state: ServerState,
    request: GenerationRequest,
    tokenize: Callable[[], list[list[int]]],
    *,
    request_ids: tuple[str, str],
    param: str,
) -> PreparedRequest:
    check_model(state, request.model)
    request = request.with_sampling_defaults(state.sampling_defaults)
    prompts = await run_in_threadpool(
        lambda: request.truncate_prompts(
            state.tokenizer, tokenize(), state.max_model_len, request.requested_max_tokens()
        )
    )
    if not prompts or not all(prompts):
        raise OpenAIError("The prompt is empty.", status_code=400, param=param)
    if (count := request.n * len(prompts)) > MAX_CHOICES:
        message = f"{len(prompts)} prompts x n = {request.n} asks for {count} choices"
        raise OpenAIError(f"{message}; at most {MAX_CHOICES} a request: split it.", param=param)
    budgets = [_max_tokens(state, request, len(ids), param) for ids in prompts]
    request_id, engine_id = request_ids
    choices = [
        Choice(index=i, trace_id=f"{engine_id}-{i}", prompt=i // request.n)
        for i in range(request.n * len(prompts))
    ]
    params = [
        request.to_sampling_params(max_tokens=budgets[c.prompt], choice=c.index % request.n)
        for c in choices
    ]
    # vLLM raises 0 < T < 0.01 to 0.01: tuning follows the temperature the engine samples at.
    engine_temperature = params[0].temperature
    if request.n > 1 and engine_temperature < GREEDY_TEMPERATURE and not request.use_beam_search:
        raise OpenAIError(
            "n must be 1 with temperature 0 (greedy choices would be equal).",
            status_code=400,
            param="n",
        )
    policy = state.policy_source.current_policy()
    client_args = request.nts_request_args()
    adapter = request_adapter(state.adapter, request.model, client_args.pop(KEY_ADAPTER, None))
    keys = _pinned_keys(policy, client_args, state.settings)
    tuning = resolve_request(keys, engine_temperature)
    correction = resolve_correction(keys)
    for choice, choice_params in zip(choices, params, strict=True):
        choice.shadow_sampled = (
            state.shadow is not None
            and adapter.as_served  # the online fit sees the model as served, adapter included
            and capturable(choice_params)
            and state.shadow.admit(choice.trace_id, budgets[choice.prompt])
        )
        add_extra_args(choice_params, issue_extra_args(_choice_keys(keys, tuning, choice)))
    return PreparedRequest(
        request_id,
        engine_id,
        prompts,
        keys,
        policy,
        tuning,
        choices,
        params,
        correction,
        adapter,
        model=request.model or state.model_name,
        prompt_kwargs=request.prompt_kwargs(),
        engine_kwargs=request.engine_kwargs(),
        beam=request.beam_search_params(budgets[0]) if request.use_beam_search else None,
    )


def _choice_keys(keys: TuningKeys, tuning: RequestTuning | None, choice: Choice) -> TuningKeys:
    """The engine keys of one choice: its trace id when tuned or sampled by the shadow scorer,
    the per-step trace and the capture of its served logits also when sampled."""
    sampled = choice.shadow_sampled
    if tuning is None and not sampled:
        return dataclasses.replace(keys, trace_id=None)
    traced = keys.trace or sampled
    return dataclasses.replace(keys, trace_id=choice.trace_id, trace=traced, capture=sampled)


def _max_tokens(state: ServerState, request: GenerationRequest, prompt_len: int, param: str) -> int:
    """The request's completion budget: all the room left when it names none, at most the
    model's generation config's ``max_tokens`` (`ServerState.sampling_defaults`), as vLLM's."""
    requested = request.requested_max_tokens()
    limit = state.max_model_len
    room = limit - prompt_len
    if room < 1 or (requested is not None and requested > room):
        wanted = prompt_len + (requested or 1)
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {wanted} tokens ({prompt_len} in the {param}, "
            f"{requested or 1} in the completion). Please reduce the length of the "
            f"{param} or the completion.",
            status_code=400,
            param=param,
            code="context_length_exceeded",
        )
    budget = room if requested is None else requested
    return min(budget, state.sampling_defaults.get("max_tokens", budget))


def _pinned_keys(
    policy: TemperaturePolicy, client_args: Mapping[str, Any], settings: Settings
) -> TuningKeys:
    """The request's `nts_*` keys over the server defaults, validated, with `policy` pinned
    (`nts_policy`): the engine applies exactly the policy the summary describes, whatever the
    estimator publishes meanwhile. Raises ValueError (HTTP 400) naming the bad key."""
    merged = dict(client_args)
    defaults = {
        KEY_RULE: settings.default_rule,
        KEY_T: settings.default_t,
        KEY_T_MIN: settings.default_t_min,
        KEY_T_MAX: settings.default_t_max,
    }
    for key, value in defaults.items():
        if value is not None and key not in merged:
            merged[key] = value
    forced_rule = merged.get(KEY_RULE) or policy.rule.value
    if KEY_T not in client_args and (KEY_RULE in client_args or forced_rule != Rule.FIXED.value):
        merged.pop(KEY_T, None)  # the server's fixed T belongs to its default fixed rule
    return dataclasses.replace(parse_request_args(merged), policy_json=policy.to_json())


# ----------------------------------------------------------------------------- running


def engine_streams(
    state: ServerState, prepared: PreparedRequest
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """All choices' engine outputs, merged, each with its choice's index (a beam search's
    `n` best beams of each prompt for its choices)."""
    if prepared.beam is not None:
        return beam_search_outputs(
            state.engine,
            state.tokenizer,
            prepared.prompts,
            prepared.params,
            prepared.beam,
            request_id=prepared.engine_id,
            lora_request=prepared.adapter.lora_request,
            prompt_kwargs=prepared.prompt_kwargs,
            engine_kwargs=prepared.engine_kwargs,
        )
    generators = [
        state.engine.generate(
            tokens_input(prepared.prompt_of(choice), **prepared.prompt_kwargs),
            params,
            choice.trace_id,
            **prepared.adapter.engine_kwargs(),
            **prepared.engine_kwargs,
        )
        for choice, params in zip(prepared.choices, prepared.params, strict=True)
    ]
    return merge_async_iterators(*generators)


def absorb(choice: Choice, request_output: RequestOutput) -> Piece:
    """Append a DELTA (or the FINAL_ONLY) output to its choice, with the prompt logprobs and
    cached tokens the engine reports with it; return what it added."""
    output = request_output.outputs[0]
    piece = Piece(
        token_ids=list(output.token_ids),
        text=output.text,
        logprobs=output.logprobs,
        finish_reason=output.finish_reason,
        text_offset=len(choice.text),
    )
    choice.token_ids.extend(piece.token_ids)
    choice.text += piece.text
    choice.finish_reason = piece.finish_reason
    if request_output.prompt_logprobs is not None:  # the first output's (echo)
        choice.prompt_logprobs = request_output.prompt_logprobs
    if request_output.num_cached_tokens is not None:
        choice.cached_tokens = request_output.num_cached_tokens
    return piece


async def summarize(state: ServerState, prepared: PreparedRequest, choice: Choice) -> NtsSummary:
    """A finished choice's `nts` summary; observes its mean T* and submits the choice to the
    shadow scorer when it was sampled. Awaits the engine's report of the choice's T* (summary,
    and the per-step trace when the client asked or the shadow scorer sampled it) when it was
    tuned."""
    n_steps = len(choice.token_ids)
    report = TraceReport()
    if prepared.tuning is None:
        trace: list[float] = [1.0] * n_steps
    elif state.trace_source is None or n_steps == 0:
        trace = []
    else:
        report = await state.trace_source.wait_for(
            choice.trace_id,
            n_steps,
            state.settings.trace_timeout_s,
            want_trace=prepared.tuning.trace or choice.shadow_sampled,
        )
        trace = list(report.trace)
        if report.steps < n_steps:
            _LOGGER.warning(
                "T* summary of %s covers %d of %d steps", choice.trace_id, report.steps, n_steps
            )
    summary = choice_summary(
        prepared.policy,
        prepared.tuning,
        trace,
        steps=n_steps,
        with_trace=prepared.keys.trace,
        report=report,
        correction=prepared.correction,
        adapter=prepared.adapter.sha256,
    )
    if summary.t_mean is not None:
        state.metrics.request_temperature_mean.labels(rule=summary.rule).observe(summary.t_mean)
    if state.shadow is not None and choice.shadow_sampled:
        state.shadow.submit(
            prepared.prompt_of(choice),
            choice.token_ids,
            trace,
            choice.trace_id,
            request_id=prepared.engine_id,
            request_temperature=prepared.params[choice.index].temperature,  # as vLLM samples
            correction=prepared.correction,
        )
    return summary


def forget_unsummarized(state: ServerState, prepared: PreparedRequest) -> None:
    """Tell the trace channel to drop what it holds for the choices that end without a summary
    (cancelled or failed): nobody will wait for their T* or take their captured rows, so it
    must not keep them."""
    if state.trace_source is None:
        return
    for choice in prepared.choices:
        if choice.summary is None:
            if prepared.tuning is not None:
                state.trace_source.forget(choice.trace_id)
            if choice.shadow_sampled and state.shadow is not None:
                state.shadow.cancel(choice.trace_id)


def overall_summary(prepared: PreparedRequest) -> NtsSummary:
    """The request-level `nts` summary over the choices summarized so far."""
    summaries = [c.summary for c in prepared.choices if c.summary is not None]
    return combine_summaries(
        prepared.policy, prepared.tuning, summaries, prepared.correction, prepared.adapter.sha256
    )


async def _run_to_end(state: ServerState, prepared: PreparedRequest) -> list[tuple[Choice, Piece]]:
    """Run every choice to its end; each with its summary and all of its output."""
    finals: dict[int, CompletionOutput] = {}
    try:
        async for index, request_output in engine_streams(state, prepared):
            absorb(prepared.choices[index], request_output)
            finals[index] = request_output.outputs[0]
        summaries = await asyncio.gather(*(summarize(state, prepared, c) for c in prepared.choices))
        for choice, summary in zip(prepared.choices, summaries, strict=True):
            choice.summary = summary
    except Exception as error:
        raise openai_error_from_exception(error) from error
    finally:
        forget_unsummarized(state, prepared)
    return [
        (c, Piece(c.token_ids, c.text, finals[c.index].logprobs, c.finish_reason, 0))
        for c in prepared.choices
    ]


async def run_unless_disconnected(
    state: ServerState, raw_request: Request, prepared: PreparedRequest
) -> list[tuple[Choice, Piece]] | None:
    """Run every choice to its end (each with its summary and all of its output), or cancel
    the run (its engine requests aborted) when the client disconnects first: None then. The
    body must have been read (FastAPI parsed it)."""
    work = asyncio.create_task(_run_to_end(state, prepared))
    disconnect = asyncio.create_task(listen_for_disconnect(raw_request))
    try:
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: the run must not outlive it
        disconnect.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))  # unlike `await work`, lets our own cancellation through
    if not work.cancelled():
        return work.result()
    _LOGGER.info("Client disconnected: aborted %s", prepared.engine_id)
    return None
