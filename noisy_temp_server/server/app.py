"""The OpenAI-compatible FastAPI app in front of vLLM's `AsyncLLM`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or server-sent events),
`GET /v1/models`, `GET /v1/nts/status`, `GET /health`, `GET /metrics`.

A request's path through `create_app`'s handlers:

1. validate the body (`protocol`), the model name, the API key and the `nts_*` keys (the one
   parser, `vllm_plugin.request_args`); tokenize (chat template for chat) and check the context
   length, all before anything reaches the engine, so a bad request costs nothing and gets an
   OpenAI error body;
2. pin the policy in force (`PolicySource.current_policy`), apply the server defaults and the
   request's overrides, and run each of the `n` choices as its own engine request with its own
   trace id;
3. join each choice's per-step T* (trace channel) with its output into the `nts` summary, feed
   the metrics, and offer the finished choice to the shadow scorer (never waiting for it).

Greedy and tuning-off requests are never touched by the processor and report T* = 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect
from vllm.inputs import TokensPrompt
from vllm.utils.async_utils import merge_async_iterators

from noisy_temp_server.server.body_limit import BodyLimitMiddleware
from noisy_temp_server.server.errors import (
    OpenAIError,
    install_error_handlers,
    openai_error_from_exception,
)
from noisy_temp_server.server.metrics import ApiMetrics, http_metrics_middleware
from noisy_temp_server.server.openapi import install_openapi
from noisy_temp_server.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
    NtsSummary,
    TopLogprob,
    Usage,
    add_extra_args,
)
from noisy_temp_server.server.temperature import (
    RequestTemperature,
    describe_policy,
    resolve_request_temperature,
)
from noisy_temp_server.settings import Settings
from noisy_temp_server.vllm_plugin.request_args import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from vllm.logprobs import SampleLogprobs
    from vllm.outputs import CompletionOutput, RequestOutput

    from noisy_temp_server.server.engine import GenerationEngine
    from noisy_temp_server.server.shadow import ShadowScorer
    from noisy_temp_server.server.temperature import PolicySource

__all__ = ["ChatTokenizer", "TraceSource", "create_app"]

_LOGGER = logging.getLogger(__name__)
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM's server uses the same floor
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer


class ChatTokenizer(Protocol):
    """What the server needs of the served model's (Hugging Face) tokenizer."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> Any: ...


class TraceSource(Protocol):
    """The API side of the trace channel (`vllm_plugin.trace_channel.TraceCollector`)."""

    def wait_for(self, trace_id: str, n_steps: int, timeout: float) -> list[float]: ...


@dataclass
class _Choice:
    """One choice's accumulated output."""

    index: int
    trace_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    summary: NtsSummary | None = None


@dataclass(frozen=True)
class _Piece:
    """What one response object reports of a choice: all of it (JSON response) or what one
    engine step added (stream chunk). `text_offset`: where `text` starts in the choice's text."""

    token_ids: Sequence[int]
    text: str
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    text_offset: int


@dataclass(frozen=True)
class _Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    temperature: RequestTemperature
    choices: list[_Choice]
    params: list[Any]  # SamplingParams per choice


def _clean_logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB) if not math.isnan(value) else _MIN_LOGPROB


def _completion_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, text_offset_start: int
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    offset = text_offset_start
    for token_id, position in zip(token_ids, logprobs, strict=False):
        candidates = position or {}
        chosen = candidates.get(token_id)
        token = (chosen.decoded_token if chosen else None) or ""
        result.tokens.append(token)
        result.token_logprobs.append(_clean_logprob(chosen.logprob) if chosen else None)
        result.top_logprobs.append(
            {(c.decoded_token or ""): _clean_logprob(c.logprob) for c in candidates.values()}
        )
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _chat_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, top: int
) -> ChatCompletionLogprobs:
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        candidates = position or {}
        chosen = candidates.get(token_id)
        token = (chosen.decoded_token if chosen else None) or ""
        ranked = sorted(
            (c for c in candidates.values() if c.rank is not None), key=lambda c: c.rank or 0
        )[:top]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_clean_logprob(chosen.logprob) if chosen else _MIN_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=c.decoded_token or "",
                        logprob=_clean_logprob(c.logprob),
                        bytes=list((c.decoded_token or "").encode()),
                    )
                    for c in ranked
                ],
            )
        )
    return ChatCompletionLogprobs(content=content)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def create_app(
    settings: Settings,
    engine: GenerationEngine,
    *,
    tokenizer: ChatTokenizer,
    model_name: str,
    max_model_len: int,
    policy_source: PolicySource,
    metrics: ApiMetrics,
    metrics_registry: CollectorRegistry,
    trace_source: TraceSource | None,
    shadow: ShadowScorer | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the app. Nothing here starts the engine, the trace collector or the shadow thread:
    their owner (the `serve` command, or a test) does, and passes `on_shutdown` to stop them
    when the app's lifespan ends (uvicorn re-raises SIGTERM/SIGINT after its shutdown, so code
    after `uvicorn.run` may never run).

    `metrics_registry` is what `/metrics` serves (in production the multiprocess registry, see
    `server.metrics`); `metrics` must be registered where that registry sees it. Without a
    `trace_source` tuned requests report no per-step T (`t_mean` etc. null).
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="noisy-temp-server", version="1", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    install_openapi(app)
    app.middleware("http")(http_metrics_middleware(metrics))
    api_key = settings.api_key.get_secret_value().encode() if settings.api_key else None

    async def require_api_key(request: Request) -> None:
        """401 unless `Authorization: Bearer <key>`. Compares bytes: a header is latin-1 text
        of any bytes (non-ASCII included), which `compare_digest` refuses as `str`."""
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token_bytes = token.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token_bytes, api_key):
            raise OpenAIError(
                "Incorrect or missing API key; send it as `Authorization: Bearer <key>`.",
                status_code=401,
                code="invalid_api_key",
            )

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise OpenAIError(
                f"The model `{requested}` does not exist; this server serves `{model_name}` "
                "(see GET /v1/models).",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    def resolve_max_tokens(
        request: CompletionRequest | ChatCompletionRequest, prompt_len: int, param: str
    ) -> int:
        requested = request.requested_max_tokens()
        room = max_model_len - prompt_len
        if room < 1 or (requested is not None and requested > room):
            wanted = prompt_len + (requested or 1)
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {wanted} tokens ({prompt_len} in the {param}, "
                f"{requested or 1} in the completion). Please reduce the length of the "
                f"{param} or the completion.",
                status_code=400,
                param=param,
                code="context_length_exceeded",
            )
        return room if requested is None else requested

    def prepare(
        request: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        prefix: str,
        param: str,
    ) -> _Prepared:
        check_model(request.model)
        if not prompt_ids:
            raise OpenAIError("The prompt is empty.", status_code=400, param=param)
        max_tokens = resolve_max_tokens(request, len(prompt_ids), param)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        choices = [_Choice(index=i, trace_id=f"{request_id}-{i}") for i in range(request.n)]
        try:
            params = [
                request.to_sampling_params(max_tokens=max_tokens, choice=choice.index)
                for choice in choices
            ]
        except ValueError as error:
            raise openai_error_from_exception(error) from None
        # vLLM raises 0 < T < 0.01 to 0.01: tuning follows the temperature the engine samples at.
        engine_temperature = params[0].temperature
        if request.n > 1 and engine_temperature < GREEDY_TEMPERATURE:
            raise OpenAIError(
                "n must be 1 with temperature 0 (greedy choices would be equal).",
                status_code=400,
                param="n",
            )
        try:
            temperature = resolve_request_temperature(
                policy_source.current_policy(),
                request.nts_request_args(),
                settings,
                request_temperature=engine_temperature,
            )
        except ValueError as error:
            raise OpenAIError(str(error), status_code=400) from None
        for choice, choice_params in zip(choices, params, strict=True):
            add_extra_args(choice_params, temperature.extra_args(choice.trace_id))
        return _Prepared(request_id, prompt_ids, temperature, choices, params)

    async def summarize(prepared: _Prepared, choice: _Choice) -> NtsSummary:
        temperature = prepared.temperature
        n_steps = len(choice.token_ids)
        if not temperature.tuned:
            trace = [1.0] * n_steps
        elif trace_source is None or n_steps == 0:
            trace = []
        else:
            trace = await asyncio.to_thread(
                trace_source.wait_for, choice.trace_id, n_steps, settings.trace_timeout_s
            )
            if len(trace) < n_steps:
                _LOGGER.warning(
                    "T* trace of %s has %d of %d steps", choice.trace_id, len(trace), n_steps
                )
        summary = temperature.summary(trace, steps=n_steps)
        if summary.t_mean is not None:
            metrics.request_temperature_mean.labels(rule=summary.rule).observe(summary.t_mean)
        if shadow is not None and choice.token_ids:
            shadow.offer(prepared.prompt_ids, choice.token_ids, trace)
        return summary

    def overall(prepared: _Prepared) -> NtsSummary:
        summaries = [c.summary for c in prepared.choices if c.summary is not None]
        return prepared.temperature.combine(summaries)

    def usage(prepared: _Prepared) -> Usage:
        completion = sum(len(c.token_ids) for c in prepared.choices)
        prompt = len(prepared.prompt_ids)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def engine_streams(prepared: _Prepared) -> AsyncIterator[tuple[int, RequestOutput]]:
        prompt = TokensPrompt(prompt_token_ids=prepared.prompt_ids)
        generators = [
            engine.generate(prompt, params, choice.trace_id)
            for choice, params in zip(prepared.choices, prepared.params, strict=True)
        ]
        return merge_async_iterators(*generators)

    def absorb(choice: _Choice, output: CompletionOutput) -> _Piece:
        """Append a DELTA (or the FINAL_ONLY) output to its choice; return what it added."""
        piece = _Piece(
            token_ids=list(output.token_ids),
            text=output.text,
            logprobs=output.logprobs,
            finish_reason=output.finish_reason,
            text_offset=len(choice.text),
        )
        choice.token_ids.extend(piece.token_ids)
        choice.text += piece.text
        choice.finish_reason = piece.finish_reason
        return piece

    async def run_to_end(prepared: _Prepared) -> list[tuple[_Choice, _Piece]]:
        """Run every choice to its end; each with its summary and all of its output."""
        finals: dict[int, CompletionOutput] = {}
        try:
            async for index, request_output in engine_streams(prepared):
                output = request_output.outputs[0]
                absorb(prepared.choices[index], output)
                finals[index] = output
            summaries = await asyncio.gather(*(summarize(prepared, c) for c in prepared.choices))
            for choice, summary in zip(prepared.choices, summaries, strict=True):
                choice.summary = summary
        except Exception as error:
            raise openai_error_from_exception(error) from error
        return [
            (c, _Piece(c.token_ids, c.text, finals[c.index].logprobs, c.finish_reason, 0))
            for c in prepared.choices
        ]

    async def run_unless_disconnected(
        raw_request: Request, prepared: _Prepared
    ) -> list[tuple[_Choice, _Piece]] | None:
        """`run_to_end`, cancelled (its engine requests aborted) when the client disconnects
        first; None then. The body must have been read (FastAPI parsed it)."""
        work = asyncio.create_task(run_to_end(prepared))
        disconnect = asyncio.create_task(listen_for_disconnect(raw_request))
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        disconnect.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        _LOGGER.info("Client disconnected: aborted %s", prepared.request_id)
        return None

    async def primed(
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

    async def stream_choices(
        request: CompletionRequest | ChatCompletionRequest,
        prepared: _Prepared,
        chunk_type: Callable[..., CompletionStreamResponse | ChatCompletionChunk],
        chunk_choice: Callable[[_Choice, _Piece], Any],
        opening: Sequence[Any] = (),
    ) -> StreamingResponse:
        """Server-sent events: one chunk per `opening` choice, one per engine output (its choice
        made by `chunk_choice`), a last chunk with the usage (if asked) and the `nts` summary,
        then `[DONE]`. Errors before the first output raise (proper status code); later ones
        are reported in-band."""
        stream = await primed(engine_streams(prepared))

        def chunk(choices: list[Any], **extra: Any) -> str:
            response = chunk_type(
                id=prepared.request_id, model=model_name, choices=choices, **extra
            )
            return _sse(response.model_dump(mode="json"))

        async def events() -> AsyncIterator[str]:
            try:
                for choice in opening:
                    yield chunk([choice])
                async for index, request_output in stream:
                    choice = prepared.choices[index]
                    piece = absorb(choice, request_output.outputs[0])
                    if piece.finish_reason is not None:
                        choice.summary = await summarize(prepared, choice)
                    yield chunk([chunk_choice(choice, piece)])
                yield chunk(
                    [],
                    usage=usage(prepared) if request.include_usage_in_stream else None,
                    nts=overall(prepared),
                )
            except Exception as error:  # after the 200 status line: report in-band
                yield _sse(openai_error_from_exception(error).body())
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as error:
            return OpenAIError(
                f"The engine cannot serve ({type(error).__name__}: {error}).", status_code=503
            ).response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.get("/v1/nts/status", dependencies=[Depends(require_api_key)])
    async def nts_status() -> JSONResponse:
        policy = policy_source.current_policy()
        return JSONResponse(
            {
                "model": model_name,
                "policy": json.loads(policy.to_json()),
                **describe_policy(policy),
                "estimator": policy_source.status(),
                "shadow": shadow.status() if shadow is not None else {"enabled": False},
            }
        )

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)], response_model=None)
    async def completions(
        request: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | StreamingResponse | Response:
        prompt = request.prompt_text_or_ids()
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prepared = prepare(request, prompt_ids, "cmpl", "prompt")

        def completion_choice(choice: _Choice, piece: _Piece) -> CompletionChoice:
            return CompletionChoice(
                text=piece.text,
                index=choice.index,
                logprobs=None
                if piece.logprobs is None
                else _completion_logprobs(piece.token_ids, piece.logprobs, piece.text_offset),
                finish_reason=piece.finish_reason,
                nts=choice.summary,
            )

        if request.stream:
            return await stream_choices(
                request, prepared, CompletionStreamResponse, completion_choice
            )
        finished = await run_unless_disconnected(raw_request, prepared)
        if finished is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        return CompletionResponse(
            id=prepared.request_id,
            model=model_name,
            choices=[completion_choice(choice, piece) for choice, piece in finished],
            usage=usage(prepared),
            nts=overall(prepared),
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)], response_model=None)
    async def chat_completions(
        request: ChatCompletionRequest, raw_request: Request
    ) -> ChatCompletionResponse | StreamingResponse | Response:
        if not tokenizer.chat_template:
            raise OpenAIError(
                f"The model `{model_name}` has no chat template; use /v1/completions.",
                status_code=400,
                param="messages",
            )
        try:
            text = tokenizer.apply_chat_template(
                request.template_messages(), tokenize=False, add_generation_prompt=True
            )
        except Exception as error:
            raise OpenAIError(
                f"The chat template could not render these messages: {error}",
                status_code=400,
                param="messages",
            ) from None
        prompt_ids = tokenizer.encode(str(text), add_special_tokens=False)
        prepared = prepare(request, prompt_ids, "chatcmpl", "messages")
        top = request.top_logprobs or 0

        def chat_logprobs(piece: _Piece) -> ChatCompletionLogprobs | None:
            return (
                None
                if piece.logprobs is None
                else _chat_logprobs(piece.token_ids, piece.logprobs, top)
            )

        def delta_choice(choice: _Choice, piece: _Piece) -> ChatChunkChoice:
            return ChatChunkChoice(
                index=choice.index,
                delta=ChatDelta(content=piece.text),
                logprobs=chat_logprobs(piece),
                finish_reason=piece.finish_reason,
                nts=choice.summary,
            )

        if request.stream:
            roles = [
                ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant"))
                for choice in prepared.choices
            ]
            return await stream_choices(
                request, prepared, ChatCompletionChunk, delta_choice, opening=roles
            )
        finished = await run_unless_disconnected(raw_request, prepared)
        if finished is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        return ChatCompletionResponse(
            id=prepared.request_id,
            model=model_name,
            choices=[
                ChatCompletionChoice(
                    index=choice.index,
                    message=ChatResponseMessage(content=piece.text),
                    logprobs=chat_logprobs(piece),
                    finish_reason=piece.finish_reason,
                    nts=choice.summary,
                )
                for choice, piece in finished
            ],
            usage=usage(prepared),
            nts=overall(prepared),
        )

    return app
