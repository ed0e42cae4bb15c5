"""`/v1/responses`: vLLM's own Responses API, its serving class (`OpenAIServingResponses`) and
its routes (`POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`)
mounted on this server's app over this server's engine, behind its API key.

It is vLLM's code end to end: its request model, renderer, tool parser (`--tool-call-parser`,
`--enable-auto-tool-choice`), state machine and response bodies. So these requests carry no
`nts_*` keys and get no `nts` object: the engine's processor serves them as the stock-vLLM
recipe does (docs/serving.md), untuned unless they name a rule in `vllm_xargs`; they are never
shadow-sampled, and on a server with a compensation adapter served through LoRA they get the
base model. The routes are left out of this server's `/openapi.json` (`server.openapi`
documents the bodies this server builds; these are vLLM's, documented by vLLM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI

from noisy_temp_server.server.auth import require_api_key

if TYPE_CHECKING:
    from noisy_temp_server.settings import Settings

__all__ = ["mount_responses"]


def mount_responses(
    app: FastAPI,
    engine: Any,
    settings: Settings,
    *,
    model_name: str,
    chat_template: str | None,
) -> None:
    """Mount vLLM's Responses API on `app`, served by `engine` (vLLM's `AsyncLLM`) as
    `model_name`, chat messages rendered with `chat_template` (None: the model's own), with the
    server flags of ``settings.vllm_args`` that vLLM's server gives it (`server.vllm_flags`)."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath  # noqa: PLC0415
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels  # noqa: PLC0415
    from vllm.entrypoints.openai.responses.api_router import router  # noqa: PLC0415
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses  # noqa: PLC0415
    from vllm.renderers.online_renderer import OnlineRenderer  # noqa: PLC0415

    from noisy_temp_server.server.vllm_flags import frontend_options  # noqa: PLC0415

    frontend = frontend_options(settings.vllm_args)
    tools: dict[str, Any] = {
        "enable_auto_tools": settings.enable_auto_tool_choice,
        "tool_parser": settings.tool_call_parser,
        "reasoning_parser": frontend.reasoning_parser,
    }
    common: dict[str, Any] = {
        "request_logger": None,
        "chat_template": chat_template,
        "default_chat_template_kwargs": dict(frontend.default_chat_template_kwargs),
        "chat_template_content_format": frontend.chat_template_content_format,
    }
    renderer = OnlineRenderer(
        engine.model_config,
        engine.renderer,
        trust_request_chat_template=frontend.trust_request_chat_template,
        exclude_tools_when_tool_choice_none=frontend.exclude_tools_when_tool_choice_none,
        **common,
        **tools,
    )
    models = OpenAIServingModels(
        engine_client=engine,
        base_model_paths=[BaseModelPath(name=model_name, model_path=engine.model_config.model)],
    )
    app.state.openai_serving_responses = OpenAIServingResponses(
        engine,
        models,
        renderer,
        return_tokens_as_token_ids=frontend.return_tokens_as_token_ids,
        enable_prompt_tokens_details=frontend.enable_prompt_tokens_details,
        enable_force_include_usage=frontend.enable_force_include_usage,
        **common,
        **tools,
    )
    app.include_router(router, dependencies=[Depends(require_api_key)], include_in_schema=False)
