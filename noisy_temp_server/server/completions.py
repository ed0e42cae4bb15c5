"""`POST /v1/completions`: a text (or token id) prompt, JSON or server-sent events.

The handler tokenizes the prompt and formats the response; admission, the engine run, the
stream and the `nts` summaries are `server.serving`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from noisy_temp_server.server.auth import require_api_key
from noisy_temp_server.server.protocol import CompletionRequest
from noisy_temp_server.server.response_bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
)
from noisy_temp_server.server.serving import (
    CLIENT_CLOSED_REQUEST,
    Choice,
    Piece,
    clean_logprob,
    overall_summary,
    prepare_request,
    run_unless_disconnected,
    usage,
)
from noisy_temp_server.server.state import ServerStateDep
from noisy_temp_server.server.streaming import stream_choices

if TYPE_CHECKING:
    from vllm.logprobs import SampleLogprobs

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=None)
async def create_completion(
    request: CompletionRequest, raw_request: Request, state: ServerStateDep
) -> CompletionResponse | StreamingResponse | Response:
    """A completion of the prompt: `n` choices, each with its `nts` summary."""
    prompt = request.prompt_text_or_ids()
    prepared = await prepare_request(
        state,
        request,
        lambda: state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt),
        prefix="cmpl",
        param="prompt",
    )
    if request.stream:
        return await stream_choices(
            state,
            request,
            prepared,
            chunk_type=CompletionStreamResponse,
            chunk_choice=_completion_choice,
        )
    finished = await run_unless_disconnected(state, raw_request, prepared)
    if finished is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return CompletionResponse(
        id=prepared.request_id,
        model=state.model_name,
        choices=[_completion_choice(choice, piece) for choice, piece in finished],
        usage=usage(prepared),
        nts=overall_summary(prepared),
    )


def _completion_choice(choice: Choice, piece: Piece) -> CompletionChoice:
    """One choice of a response (all of it) or of a stream chunk (what one step added)."""
    return CompletionChoice(
        text=piece.text,
        index=choice.index,
        logprobs=None
        if piece.logprobs is None
        else _completion_logprobs(piece.token_ids, piece.logprobs, piece.text_offset),
        finish_reason=piece.finish_reason,
        nts=choice.summary,
    )


def _completion_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, text_offset_start: int
) -> CompletionLogprobs:
    """The legacy completions logprobs: tokens, their logprobs, the top candidates by token
    text, and each token's offset in the choice's text."""
    result = CompletionLogprobs()
    offset = text_offset_start
    for token_id, position in zip(token_ids, logprobs, strict=False):
        candidates = position or {}
        chosen = candidates.get(token_id)
        token = (chosen.decoded_token if chosen else None) or ""
        result.tokens.append(token)
        result.token_logprobs.append(clean_logprob(chosen.logprob) if chosen else None)
        result.top_logprobs.append(
            {(c.decoded_token or ""): clean_logprob(c.logprob) for c in candidates.values()}
        )
        result.text_offset.append(offset)
        offset += len(token)
    return result
