"""`POST /v1/chat/completions`: messages rendered by the model's chat template, JSON or
server-sent events.

The handler renders and tokenizes the messages and formats the response; admission, the engine
run, the stream and the `nts` summaries are `server.serving`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.exceptions import VLLMClientError
from vllm.renderers.hf import resolve_chat_template_kwargs

from noisy_temp_server.server.auth import require_api_key
from noisy_temp_server.server.chat_messages import ChatMessage, content_format, template_messages
from noisy_temp_server.server.errors import OpenAIError, openai_error_from_exception
from noisy_temp_server.server.protocol import ChatCompletionRequest
from noisy_temp_server.server.response_bodies import (
    MIN_LOGPROB,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogprobs,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatTokenLogprob,
    LogprobTokens,
    TopLogprob,
    clean_logprob,
    prompt_logprobs_body,
)
from noisy_temp_server.server.serving import (
    CLIENT_CLOSED_REQUEST,
    Choice,
    Piece,
    overall_summary,
    prepare_request,
    run_unless_disconnected,
)
from noisy_temp_server.server.state import ServerState, ServerStateDep
from noisy_temp_server.server.streaming import stream_choices
from noisy_temp_server.server.tools import ChatOutputParsing
from noisy_temp_server.server.usage import reported_cached_tokens, usage
from noisy_temp_server.server.vllm_fields import ChatTemplateFields

if TYPE_CHECKING:
    from vllm.logprobs import SampleLogprobs

__all__ = ["chat_logprobs", "chat_prompt", "render_messages", "router"]

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    request: ChatCompletionRequest, raw_request: Request, state: ServerStateDep
) -> ChatCompletionResponse | StreamingResponse | Response:
    """The assistant's next message: `n` choices, each with its `nts` summary (and the
    reasoning and tool calls vLLM's parsers find in it, `server.tools`), with the token ids and
    the rendered prompt when asked (`return_token_ids`, `return_prompt_text`), as vLLM's
    server; the answer's role is ``--response-role`` when the request opens that turn, else the
    last message's (vLLM's `get_chat_request_role`)."""
    role = (
        state.frontend.response_role if request.add_generation_prompt else request.messages[-1].role
    )
    parsing = _output_parsing(state, request)
    rendered = _RenderedPrompt(state, request)
    header_id = raw_request.headers.get("X-Request-Id")
    prepared = await prepare_request(
        state, request, rendered.prompts, prefix="chatcmpl", param="messages", header_id=header_id
    )
    engine_kwargs = {**prepared.engine_kwargs, **parsing.engine_kwargs(prepared.prompts[0])}
    prepared = dataclasses.replace(prepared, engine_kwargs=engine_kwargs)
    as_ids = request.return_tokens_as_token_ids
    tokens = LogprobTokens(
        top=request.top_logprobs or 0,
        as_ids=state.frontend.return_tokens_as_token_ids if as_ids is None else as_ids,
        every_candidate=bool(request.logprob_token_ids),
    )
    echoed = _echoed(request, role)
    prompt_fields = {
        "prompt_token_ids": prepared.prompts[0] if request.return_token_ids else None,
        "prompt_text": rendered.text if request.return_prompt_text else None,
    }
    if request.stream:
        roles = [
            ChatChunkChoice(index=choice.index, delta=ChatDelta(role=role, content=echoed or None))
            for choice in prepared.choices
        ]
        delta_choice = functools.partial(
            _delta_choice,
            tokens=tokens,
            parsing=parsing,
            prompt=prepared.prompts[0],
            with_ids=bool(request.return_token_ids),
        )
        return await stream_choices(
            state,
            request,
            prepared,
            chunk_type=ChatCompletionChunk,
            chunk_choice=delta_choice,
            opening=roles,
            opening_fields=prompt_fields,
            reasoning_tokens=parsing.reasoning_tokens,
        )
    finished = await run_unless_disconnected(state, raw_request, prepared)
    if finished is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    message_choice = functools.partial(
        _message_choice,
        role=role,
        echoed=echoed,
        tokens=tokens,
        parsing=parsing,
        prompt=prepared.prompts[0],
        with_ids=bool(request.return_token_ids),
    )
    choices = [message_choice(choice, piece) for choice, piece in finished]
    return ChatCompletionResponse(
        id=prepared.request_id,
        model=prepared.model,
        choices=choices,
        usage=usage(
            prepared,
            cached_tokens=reported_cached_tokens(state, prepared),
            reasoning_tokens=parsing.reasoning_tokens(prepared.choices),
        ),
        prompt_logprobs=prompt_logprobs_body(prepared.choices[0].prompt_logprobs),
        **prompt_fields,
        nts=overall_summary(prepared),
    )


def _output_parsing(state: ServerState, request: ChatCompletionRequest) -> ChatOutputParsing:
    """The request's reasoning and tool calling; a 400 for what vLLM's request model or server
    refuses."""
    try:
        return ChatOutputParsing(
            request,
            state.output_parser,
            state.tokenizer,
            auto_tools=state.settings.enable_auto_tool_choice,
            template_kwargs=request.template_kwargs(state.frontend.default_chat_template_kwargs),
        )
    except VLLMClientError as error:
        raise openai_error_from_exception(error) from None
    except ValueError as error:  # vLLM's tool schema helpers raise plain ValueErrors
        raise OpenAIError(str(error), status_code=400, param="tools") from None


def _echoed(request: ChatCompletionRequest, role: str) -> str:
    """What `echo` puts before each choice's text, as vLLM's server does: the last message's
    text when it has the answer's `role`; empty without `echo`."""
    last = request.messages[-1]
    return last.text() if request.echo and last.role == role else ""


class _RenderedPrompt:
    """The request's messages rendered by the chat template (`chat_prompt`): `prompts()`
    renders and tokenizes them (the token ids of the request's one prompt); `text` is the
    rendered text once it has (vLLM's `prompt_text`)."""

    def __init__(self, state: ServerState, request: ChatCompletionRequest) -> None:
        self.state = state
        self.request = request
        self.text = ""

    def prompts(self) -> list[list[int]]:
        self.text, ids = chat_prompt(self.state, self.request.messages, self.request)
        return [ids]


def chat_prompt(
    state: ServerState, messages: Sequence[ChatMessage], fields: ChatTemplateFields
) -> tuple[str, list[int]]:
    """`messages` rendered by the chat template (the request's own with
    ``--trust-request-chat-template``, else a 400 as vLLM's), their content in the format of
    ``--chat-template-content-format`` (`server.chat_messages`), with the request's template fields
    (`ChatTemplateFields.template_kwargs`: the assistant's turn opened by default, its tools,
    over ``--default-chat-template-kwargs``), and the rendered text's token ids (special tokens
    added on top only with `add_special_tokens`, as vLLM's); a 400 as `render_messages` says,
    or vLLM's for a tool call `template_messages` refuses."""
    frontend = state.frontend
    template = fields.own_chat_template(trusted=frontend.trust_request_chat_template)
    kwargs = fields.template_kwargs(
        frontend.default_chat_template_kwargs,
        exclude_tools_when_none=frontend.exclude_tools_when_tool_choice_none,
    )
    rendered_by = template or state.tokenizer.chat_template
    shape = content_format(frontend.chat_template_content_format, rendered_by)
    try:
        as_template_takes = template_messages(messages, shape)
    except VLLMClientError as error:  # vLLM's refusal of a tool call in the history
        raise openai_error_from_exception(error) from None
    text = render_messages(state, as_template_takes, kwargs, template)
    return text, state.tokenizer.encode(text, add_special_tokens=fields.add_special_tokens)


def render_messages(
    state: ServerState,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any],
    chat_template: str | None = None,
) -> str:
    """`messages` rendered by `chat_template` (None: the model's) with `template_kwargs`
    (`add_generation_prompt` opens the assistant's turn), those the template does not take left
    out as vLLM leaves them out (`resolve_chat_template_kwargs`); a 400 when there is no
    template or it cannot render them."""
    tokenizer = state.tokenizer
    template = chat_template or tokenizer.chat_template
    if not template:
        raise OpenAIError(
            f"The model `{state.model_name}` has no chat template; use /v1/completions.",
            status_code=400,
            param="messages",
        )
    try:
        hf_tokenizer: Any = tokenizer  # vLLM reads the signature of its `apply_chat_template`
        kwargs = resolve_chat_template_kwargs(hf_tokenizer, template, dict(template_kwargs))
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as error:
        raise OpenAIError(
            f"The chat template could not render these messages: {error}",
            status_code=400,
            param="messages",
        ) from None
    return str(text)


def _message_choice(
    choice: Choice,
    piece: Piece,
    *,
    role: str,
    echoed: str,
    tokens: LogprobTokens,
    parsing: ChatOutputParsing,
    prompt: list[int],
    with_ids: bool,
) -> ChatCompletionChoice:
    """A finished choice: its message (`echoed` first; its reasoning and tool calls apart), its
    token ids `with_ids` and its logprobs, unless `parsing.hides_metadata`."""
    reasoning, content, calls, finish_reason = parsing.parse(
        choice.index, piece.text, list(piece.token_ids), prompt, piece.finish_reason
    )
    message = ChatResponseMessage(
        role=role,
        content=None if content is None else echoed + content,
        reasoning=reasoning,
        tool_calls=calls,
    )
    shown = not parsing.hides_metadata
    return ChatCompletionChoice(
        index=choice.index,
        message=message,
        logprobs=_piece_logprobs(piece, tokens) if shown else None,
        finish_reason=finish_reason,
        token_ids=choice.token_ids if with_ids and shown else None,
        nts=choice.summary,
    )


def _delta_choice(
    choice: Choice,
    piece: Piece,
    *,
    tokens: LogprobTokens,
    parsing: ChatOutputParsing,
    prompt: list[int],
    with_ids: bool,
) -> ChatChunkChoice | None:
    """One stream chunk's choice: what one engine step added (its reasoning and tool-call
    deltas apart; its token ids `with_ids`, its logprobs, unless `parsing.hides_metadata`);
    None for no chunk, as vLLM's stream sends none, when the step adds nothing to show and the
    choice goes on."""
    finished = piece.finish_reason is not None
    delta = parsing.parse_delta(
        choice.index, piece.text, list(piece.token_ids), prompt, finished=finished
    )
    shown = not parsing.hides_metadata
    logprobs = _piece_logprobs(piece, tokens) if shown else None
    with_ids = with_ids and shown
    if delta is None:
        if not finished and logprobs is None and not with_ids:
            return None
        delta = DeltaMessage()
    return ChatChunkChoice(
        index=choice.index,
        delta=ChatDelta(
            content=delta.content, reasoning=delta.reasoning, tool_calls=list(delta.tool_calls)
        ),
        logprobs=logprobs,
        finish_reason=parsing.stream_finish_reason(choice.index, piece.finish_reason),
        token_ids=list(piece.token_ids) if with_ids else None,
        nts=choice.summary,
    )


def _piece_logprobs(piece: Piece, tokens: LogprobTokens) -> ChatCompletionLogprobs | None:
    if piece.logprobs is None:
        return None
    return chat_logprobs(piece.token_ids, piece.logprobs, tokens)


def chat_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, tokens: LogprobTokens
) -> ChatCompletionLogprobs:
    """Chat logprobs: each token with its logprob, bytes and the first `tokens.top` candidates
    in the engine's order, as vLLM's server lists them: the sampled token first, then the best
    others by rank (so a sampled token outside the top ones displaces the last of them);
    every candidate the engine returned with `tokens.every_candidate`; named by `tokens`."""
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        candidates = position or {}
        chosen = candidates.get(token_id)
        token = tokens.name(token_id, chosen.decoded_token if chosen else None) or ""
        listed = list(candidates.items())
        if not tokens.every_candidate:
            listed = listed[: tokens.top]
        named = [(tokens.name(i, c.decoded_token) or "", c.logprob) for i, c in listed]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=clean_logprob(chosen.logprob) if chosen else MIN_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=[
                    TopLogprob(token=name, logprob=clean_logprob(value), bytes=list(name.encode()))
                    for name, value in named
                ],
            )
        )
    return ChatCompletionLogprobs(content=content)
