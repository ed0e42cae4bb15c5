"""Server-sent events for `/v1/completions` and `/v1/chat/completions`: `stream_choices` runs a
prepared request's choices on the engine (`server.serving`) and streams one chunk per engine
output, then the usage and the `nts` summary, then `[DONE]`; the engine requests and the
shadow scorer's samples are released however the response ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from noisy_temp_server.server.errors import openai_error_from_exception
from noisy_temp_server.server.response_bodies import Usage
from noisy_temp_server.server.serving import (
    Choice,
    GenerationRequest,
    Piece,
    PreparedRequest,
    absorb,
    engine_streams,
    forget_unsummarized,
    overall_summary,
    summarize,
)
from noisy_temp_server.server.usage import (
    reported_cached_tokens,
    stream_usage,
    usage,
    usage_so_far,
)

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

    from noisy_temp_server.server.response_bodies import (
        ChatCompletionChunk,
        CompletionStreamResponse,
    )
    from noisy_temp_server.server.state import ServerState

__all__ = ["stream_choices"]


async def _primed(
    stream: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Fetch the first item now (so admission errors still get a proper status code)."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except Exception as error:
        raise openai_error_from_exception(error) from error

    async def rest() -> AsyncIterator[tuple[int, RequestOutput]]:
        if first is None:
            return
        yield first
        async for item in stream:
            yield item

    return rest()


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream_choices(
    state: ServerState,
    request: GenerationRequest,
    prepared: PreparedRequest,
    *,
    chunk_type: Callable[..., CompletionStreamResponse | ChatCompletionChunk],
    chunk_choice: Callable[[Choice, Piece], Any | None],
    opening: Sequence[Any] = (),
    opening_fields: Mapping[str, Any] | None = None,
    reasoning_tokens: Callable[[Sequence[Choice]], int | None] = lambda _: None,
) -> StreamingResponse:
    """Server-sent events: one chunk per `opening` choice (each with `opening_fields`, vLLM's prompt
    token ids and text when asked), one per engine output (its choice made by `chunk_choice`; none
    when that makes None), a last chunk with the usage (if asked, `server.usage`) and the `nts`
    summary, then `[DONE]`. As in vLLM's server, no other chunk has the `usage` key, but with
    `stream_options.continuous_usage_stats` (or ``--enable-force-include-usage``): then every chunk
    has its choice's usage so far (its prompt's tokens and the tokens it generated; 0 on an opening
    chunk). Errors before the first output raise (proper status code); later ones are reported
    in-band. When the response's ASGI call ends, whether or not its body was ever iterated, the
    engine requests still running are aborted and the choices that end without a summary are
    cancelled on the shadow scorer and forgotten on the trace channel. `reasoning_tokens`: the
    reasoning tokens of some choices, for the usage's `completion_tokens_details` (None: no
    details)."""
    engine = engine_streams(state, prepared)
    try:
        stream = await _primed(engine)
    except BaseException:  # refused or cancelled before its first output: no `release`
        forget_unsummarized(state, prepared)
        raise

    async def release() -> None:
        forget_unsummarized(state, prepared)
        await engine.aclose()  # aborts what the body did not run to its end

    final_usage, continuous = stream_usage(state, request)

    def choice_usage(choice: Choice) -> Usage | None:
        if not continuous:
            return None
        return usage_so_far(prepared, choice, reasoning_tokens=reasoning_tokens([choice]))

    def chunk(choices: list[Any], **extra: Any) -> str:
        response = chunk_type(
            id=prepared.request_id, model=prepared.model, choices=choices, **extra
        )
        body = response.model_dump(mode="json")
        if body["usage"] is None:
            del body["usage"]  # as vLLM's server: only the chunk that reports it has the key
        return _sse(body)

    async def events() -> AsyncIterator[str]:
        first: Choice | None = None  # the choice of the first output (its cached tokens)
        try:
            for opened in opening:
                started = prepared.choices[opened.index]
                yield chunk([opened], usage=choice_usage(started), **(opening_fields or {}))
            async for index, request_output in stream:
                choice = prepared.choices[index]
                if first is None:
                    first = choice
                piece = absorb(choice, request_output)
                if piece.finish_reason is not None:
                    choice.summary = await summarize(state, prepared, choice)
                made = chunk_choice(choice, piece)
                if made is not None:
                    yield chunk([made], usage=choice_usage(choice))
            cached = reported_cached_tokens(state, prepared, first)
            reasoning = reasoning_tokens(prepared.choices)
            final = usage(prepared, cached_tokens=cached, reasoning_tokens=reasoning)
            yield chunk([], usage=final if final_usage else None, nts=overall_summary(prepared))
        except Exception as error:  # after the 200 status line: report in-band
            yield _sse(openai_error_from_exception(error).body())
        yield _sse("[DONE]")

    return _ReleasingStreamingResponse(events(), release=release, media_type="text/event-stream")


class _ReleasingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that awaits `release` once its ASGI call ends, however it ends:
    streamed to the end, the client gone mid-stream, the client gone before Starlette iterates
    the body at all (the body's generator then never starts, so a `finally` in it never runs),
    sending failed or the call cancelled (Starlette then skips its `background` task).
    `release` runs shielded from that cancellation."""

    def __init__(
        self,
        content: AsyncIterator[str],
        *,
        release: Callable[[], Awaitable[None]],
        media_type: str,
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()
