"""The OpenAI-compatible FastAPI app in front of vLLM's `AsyncLLM`: the factory that wires it.

One module per endpoint family, each an `APIRouter` over the shared `ServerState`:

- `completions`: `POST /v1/completions`;
- `chat`: `POST /v1/chat/completions`;
- `models`: `GET /v1/models`;
- `status`: `GET /v1/nts/status`;
- `health`: `GET /health`, `GET /metrics`;
- `tokenization`: `POST /tokenize`, `POST /detokenize`, `GET /version` (as vLLM's server);
- `dashboard`: the status page (`GET /`, `GET /dashboard`, its assets) and its data,
  `GET /v1/nts/dashboard`.

The two generation endpoints share `generation` (admission, fan-out of the `n` choices, run to
end or stream, `nts` summaries, disconnects); `auth` is the API key dependency of the `/v1/*`
routes; `errors` turns every failure into an OpenAI error body.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from noisy_temp_server.server import chat, completions, health, models, status, tokenization
from noisy_temp_server.server.adapter import adapter_status
from noisy_temp_server.server.auth import require_api_key
from noisy_temp_server.server.body_limit import BodyLimitMiddleware
from noisy_temp_server.server.dashboard import dashboard_router
from noisy_temp_server.server.errors import install_error_handlers
from noisy_temp_server.server.metrics import ApiMetrics, HttpMetricsMiddleware
from noisy_temp_server.server.openapi import install_openapi
from noisy_temp_server.server.state import ChatTokenizer, ServerState, attach_state
from noisy_temp_server.server.vllm_flags import FrontendOptions, frontend_options, middleware
from noisy_temp_server.settings import Settings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from vllm.parser.abstract_parser import Parser

    from noisy_temp_server.adapter.serving import ServedAdapter
    from noisy_temp_server.engine_contract.trace_channel import TraceSource
    from noisy_temp_server.online.policy_source import PolicySource
    from noisy_temp_server.online.shadow import ShadowScorer
    from noisy_temp_server.server.engine import GenerationEngine

__all__ = ["create_app"]


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
    adapter: ServedAdapter | None = None,
    output_parser: type[Parser] | None = None,
    sampling_defaults: Mapping[str, Any] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the app over one `ServerState` of these parts (see `ServerState` for each).

    Nothing here starts the engine, the trace collector or the shadow thread: their owner (the
    `serve` command, or a test) does, and passes `on_shutdown` to stop them when the app's
    lifespan ends (uvicorn re-raises SIGTERM/SIGINT after its shutdown, so code after
    `uvicorn.run` may never run).

    `metrics_registry` is what `/metrics` serves (in production the multiprocess registry, see
    `server.metrics`); `metrics` must be registered where that registry sees it. Without a
    `trace_source` tuned requests report no per-step T (`t_mean` etc. null). vLLM's server
    flags in the settings' ``vllm_args`` apply as on vLLM's server (`server.vllm_flags`;
    ValueError, one line, for one refused there).
    """
    frontend = frontend_options(settings.vllm_args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            on_shutdown()

    docs: dict[str, Any] = {}
    if frontend.disable_fastapi_docs:
        docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="noisy-temp-server", version="1", lifespan=lifespan, **docs)
    attach_state(
        app,
        ServerState(
            settings=settings,
            engine=engine,
            tokenizer=tokenizer,
            model_name=model_name,
            max_model_len=max_model_len,
            policy_source=policy_source,
            metrics=metrics,
            metrics_registry=metrics_registry,
            trace_source=trace_source,
            shadow=shadow,
            adapter=adapter,
            output_parser=output_parser,
            sampling_defaults=dict(sampling_defaults or {}),
            frontend=frontend,
        ),
    )
    served_adapter = adapter_status(adapter)
    metrics.publish_adapter(served_adapter["path"], served_adapter["sha256"])
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    install_openapi(app)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    _add_outer_middleware(app, settings, frontend)
    if settings.root_path is not None:
        app.root_path = settings.root_path
    for module in (health, models, status, completions, chat, tokenization):
        app.include_router(module.router)
    app.include_router(dashboard_router(metrics_registry, require_api_key))
    return app


def _add_outer_middleware(app: FastAPI, settings: Settings, frontend: FrontendOptions) -> None:
    """CORS, outside this server's middleware (a preflight is answered before them); then, as
    vLLM's server adds them, `X-Request-Id` on every response (vLLM's own middleware) and the
    ``--middleware`` given, outermost (a class as ASGI middleware, a coroutine function as
    HTTP middleware)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(settings.allowed_origins),
        allow_credentials=settings.allow_credentials,
        allow_methods=list(settings.allowed_methods),
        allow_headers=list(settings.allowed_headers),
    )
    if frontend.enable_request_id_headers:
        from vllm.entrypoints.serve.middleware.x_request_id import (  # noqa: PLC0415
            XRequestIdMiddleware,
        )

        app.add_middleware(XRequestIdMiddleware)
    for path in frontend.middleware:
        imported = middleware(path)
        if isinstance(imported, type):
            app.add_middleware(imported)  # type: ignore[arg-type]
        else:
            app.middleware("http")(imported)
