"""`POST /v1/completions`: a text (or token id) prompt, JSON or server-sent events.

The handler tokenizes the prompt and formats the response; admission, the engine run and the
`nts` summaries are `server.serving`'s, the stream `server.streaming`'s.

`echo` puts the prompt before each choice's text, as vLLM's server does (streamed: in each
choice's first chunk, with the prompt's token ids, as vLLM's); with `logprobs` the prompt
tokens get theirs too (the first has none: null), and `max_tokens: 0` returns the prompt
alone. Prompt logprobs are the served model's own: vLLM computes them from the model's logits,
before any logits processor, so neither T* nor the per-token bias touches them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from noisy_temp_server.server.auth import require_api_key
from noisy_temp_server.server.protocol import CompletionRequest
from noisy_temp_server.server.response_bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    LogprobTokens,
    clean_logprob,
    prompt_logprobs_body,
)
from noisy_temp_server.server.serving import (
    CLIENT_CLOSED_REQUEST,
    Choice,
    Piece,
    PreparedRequest,
    overall_summary,
    prepare_request,
    run_unless_disconnected,
)
from noisy_temp_server.server.state import ServerStateDep
from noisy_temp_server.server.streaming import stream_choices
from noisy_temp_server.server.usage import reported_cached_tokens, usage

if TYPE_CHECKING:
    from vllm.logprobs import LogprobsOnePosition, PromptLogprobs

    from noisy_temp_server.server.state import ServerState

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=None)
async def create_completion(
    request: CompletionRequest, raw_request: Request, state: ServerStateDep
) -> CompletionResponse | StreamingResponse | Response:
    """A completion of the prompt (of each prompt of a list): `n` choices per prompt, each with
    its `nts` summary (and its prompt's and its own token ids with `return_token_ids`)."""
    prompts = request.prompts_text_or_ids()
    prepared = await prepare_request(
        state,
        request,
        lambda: [state.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts],
        prefix="cmpl",
        param="prompt",
        header_id=raw_request.headers.get("X-Request-Id"),
    )
    as_ids = request.return_tokens_as_token_ids
    tokens = LogprobTokens(
        as_ids=state.frontend.return_tokens_as_token_ids if as_ids is None else as_ids,
        every_candidate=bool(request.logprob_token_ids),
    )
    with_ids = bool(request.return_token_ids)
    echoes = [
        _Echo(prompt, ids, request.echoes_prompt_only, state, with_text=not with_ids)
        for prompt, ids in zip(prompts, prepared.prompts, strict=True)
        if request.echo
    ]
    decode = _decoder(state)
    if request.stream:
        return await stream_choices(
            state,
            request,
            prepared,
            chunk_type=CompletionStreamResponse,
            chunk_choice=_StreamedChoices(prepared, tokens, decode, with_ids, echoes),
        )
    finished = await run_unless_disconnected(state, raw_request, prepared)
    if finished is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if echoes:
        finished = [(c, echoes[c.prompt].prepend(c, piece)) for c, piece in finished]
    choices = [
        _completion_choice(
            choice,
            piece,
            tokens,
            decode,
            prompt_ids=prepared.prompt_of(choice) if with_ids else None,
            token_ids=choice.token_ids if with_ids else None,
            prompt_logprobs=choice.prompt_logprobs,
        )
        for choice, piece in finished
    ]
    return CompletionResponse(
        id=prepared.request_id,
        model=prepared.model,
        choices=choices,
        usage=usage(prepared, cached_tokens=reported_cached_tokens(state, prepared)),
        nts=overall_summary(prepared),
    )


@dataclass(frozen=True)
class _Echo:
    """The prompt a choice echoes: its text (decoded when it came as token ids; none
    without `with_text`, as vLLM's server echoes no text with `return_token_ids`), its ids, and
    whether the generated token is left out (`max_tokens: 0`)."""

    prompt: str | list[int]
    prompt_ids: list[int]
    prompt_only: bool
    state: ServerState
    with_text: bool = True

    def prepend(self, choice: Choice, piece: Piece) -> Piece:
        """`piece` (a whole choice) with the prompt before it: text, token ids and, when the
        choice has prompt logprobs, logprobs."""
        text = self.prompt if isinstance(self.prompt, str) else _decoder(self.state)(self.prompt)
        generated = Piece([], "", [], piece.finish_reason, 0) if self.prompt_only else piece
        logprobs = None
        if choice.prompt_logprobs is not None and piece.logprobs is not None:
            logprobs = [*choice.prompt_logprobs, *(generated.logprobs or [])]
        return Piece(
            token_ids=[*self.prompt_ids, *generated.token_ids],
            text=(text if self.with_text else "") + generated.text,
            logprobs=logprobs,
            finish_reason=piece.finish_reason,
            text_offset=0,
        )


@dataclass
class _StreamedChoices:
    """The choices of a stream's chunks, each what one engine step added, as vLLM's server
    makes them: `with_ids`, each with its token ids and a choice's first chunk with its
    prompt's; with `echoes` (one per prompt), a choice's first chunk starts with its prompt's
    echo and carries the prompt's ids. The logprobs' text offsets go on from the tokens reported
    so far (vLLM's: text held back for a stop string lags them)."""

    prepared: PreparedRequest
    tokens: LogprobTokens
    decode: Callable[[Sequence[int]], str]
    with_ids: bool
    echoes: Sequence[_Echo] = ()
    started: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)

    def __call__(self, choice: Choice, piece: Piece) -> CompletionChoice:
        first = choice.index not in self.started
        self.started.add(choice.index)
        reported = (
            self.echoes[choice.prompt].prepend(choice, piece) if first and self.echoes else piece
        )
        reported = dataclasses.replace(reported, text_offset=self.offsets.get(choice.index, 0))
        streamed = _completion_choice(
            choice,
            reported,
            self.tokens,
            self.decode,
            prompt_ids=self.prepared.prompt_of(choice)
            if first and (self.with_ids or self.echoes)
            else None,
            token_ids=list(piece.token_ids) if self.with_ids else None,
        )
        if streamed.logprobs is not None and streamed.logprobs.tokens:
            last = streamed.logprobs
            self.offsets[choice.index] = last.text_offset[-1] + len(last.tokens[-1])
        return streamed


def _decoder(state: ServerState) -> Callable[[Sequence[int]], str]:
    """Token ids to text with the served model's tokenizer (special tokens kept, as vLLM's
    prompt text)."""
    # A flat list of ids decodes to one string (a list of lists would give one per list).
    return lambda token_ids: cast(str, state.tokenizer.decode(list(token_ids)))


def _completion_choice(
    choice: Choice,
    piece: Piece,
    tokens: LogprobTokens,
    decode: Callable[[Sequence[int]], str] | None = None,
    *,
    prompt_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> CompletionChoice:
    """One choice of a response (all of it) or of a stream chunk (what one step added), with
    `prompt_ids`, `token_ids` and `prompt_logprobs` when given. `decode` names the tokens whose
    logprobs carry no text (the first prompt token)."""
    return CompletionChoice(
        text=piece.text,
        index=choice.index,
        logprobs=None
        if piece.logprobs is None
        else _completion_logprobs(
            piece.token_ids, piece.logprobs, piece.text_offset, decode, tokens
        ),
        finish_reason=piece.finish_reason,
        prompt_logprobs=prompt_logprobs_body(prompt_logprobs),
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        nts=choice.summary,
    )


def _completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[LogprobsOnePosition | None],
    text_offset_start: int,
    decode: Callable[[Sequence[int]], str] | None,
    tokens: LogprobTokens,
) -> CompletionLogprobs:
    """The legacy completions logprobs: tokens, their logprobs (null where the engine gives
    none: the first prompt token), the candidates the engine returned by token name (null there
    too), and each token's offset in the choice's text; tokens named by `tokens`."""
    result = CompletionLogprobs()
    offset = text_offset_start
    for token_id, position in zip(token_ids, logprobs, strict=False):
        candidates = position or {}
        chosen = candidates.get(token_id)
        token = tokens.name(token_id, chosen.decoded_token if chosen else None)
        if token is None:
            token = decode([token_id]) if decode is not None else ""
        result.tokens.append(token)
        result.token_logprobs.append(clean_logprob(chosen.logprob) if chosen else None)
        result.top_logprobs.append(
            None
            if position is None
            else {
                (tokens.name(i, c.decoded_token) or ""): clean_logprob(c.logprob)
                for i, c in candidates.items()
            }
        )
        result.text_offset.append(offset)
        offset += len(token)
    return result
