"""vLLM's own flags on `serve`: what `vllm serve` takes, read by vLLM's own parser (`vllm serve`'s
`make_arg_parser`: `FrontendArgs.add_cli_args` next to `AsyncEngineArgs.add_cli_args`), so
vLLM's types, choices and validation are used.

They reach it as the setting ``vllm_args`` (on the command line, every flag `serve` does not
have), the one path for both kinds:

- the engine's flags (prefix caching, the KV cache's dtype, chunked prefill, the seed,
  speculative decoding...): `engine_flag_overrides`, applied over the engine arguments `serve`
  builds (`server.engine.build_engine_args`);
- the server's (frontend) flags `serve` takes: `frontend_options`, a `FrontendOptions` the app
  (`server.app.create_app`) and uvicorn (`server.launch.uvicorn_config`) apply with vLLM's
  meaning (docs/serving.md).

Refused, in one line naming the flag, by both alike: a flag `vllm serve` does not have, a bad
value (vLLM's parser's message), a flag that is a setting of `serve` (pass it as that setting),
one `serve` sets itself (`_SET_BY_SERVE`), and each of vLLM's server flags `serve` does not take,
with why (`NOT_TAKEN`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from noisy_temp_server.settings import Settings

if TYPE_CHECKING:
    from noisy_temp_server.server.chat_messages import ContentFormatOption

__all__ = [
    "NOT_TAKEN",
    "FrontendOptions",
    "engine_flag_overrides",
    "frontend_options",
    "middleware",
]

_SET_BY_SERVE = (
    "model", "tokenizer", "kv_cache_memory_bytes", "logprobs_mode", "max_logprobs",
    "logits_processors", "enable_lora", "max_lora_rank", "max_loras",
)  # fmt: skip
"""Engine arguments `serve` sets itself: the served model and its tokenizer, the KV cache
(``--kv-cache-gib``), what the processors and the adapter need."""

_NO_SUPERVISOR = "serve runs no data-parallel supervisor"
_NO_COHERE = "serve has no Cohere endpoint"
_NO_LOGGER = "serve logs no prompts nor generations (vLLM's request logger is its server's)"
_NO_SCALE_OUT = "serve has no tokens-only nor scale-out endpoints"
_NO_FINGERPRINT = "serve's responses carry no system_fingerprint"
NOT_TAKEN: dict[str, str] = {
    "model_tag": "give the model as --served-model",
    "headless": "serve always runs its API server with its engine",
    "api_server_count": "serve runs one API server process",
    "config": "serve reads no vLLM config file: give the flags themselves",
    "grpc": "serve answers over HTTP only",
    "grpc_port": "serve answers over HTTP only",
    "lora_modules": "serve fits and loads its own adapter",
    "trust_request_mm_kwargs": "serve takes text prompts only",
    "tool_parser_plugin": "serve takes vLLM's built-in tool parsers only",
    "tool_strict_level": "serve's tool calls follow vLLM's default ('auto')",
    "tool_server": "serve has no built-in tools for the Responses API",
    "max_log_len": _NO_LOGGER,
    "enable_log_outputs": _NO_LOGGER,
    "enable_log_deltas": _NO_LOGGER,
    "enable_per_request_metrics": "serve's responses carry the nts object, not vLLM's metrics",
    "enable_server_load_tracking": "serve has no /load endpoint",
    "sse_keep_alive_interval": "serve's streams send no keep-alive comments",
    "enable_tokenizer_info_endpoint": "serve has no /tokenizer_info endpoint",
    "cohere_is_reasoning_model": _NO_COHERE,
    "cohere_format": _NO_COHERE,
    "anthropic_disabled_thinking_effort": "serve has no Anthropic endpoint",
    "log_error_stack": "serve logs the stack trace of unexpected errors (500) only",
    "tokens_only": _NO_SCALE_OUT,
    "enable_scale_out": _NO_SCALE_OUT,
    "fingerprint_mode": _NO_FINGERPRINT,
    "fingerprint_value": _NO_FINGERPRINT,
    "data_parallel_supervisor_port": _NO_SUPERVISOR,
    "dp_supervisor_probe_interval_s": _NO_SUPERVISOR,
    "dp_supervisor_probe_timeout_s": _NO_SUPERVISOR,
    "dp_supervisor_probe_failure_threshold": _NO_SUPERVISOR,
    "enable_ssl_refresh": "serve reads its TLS files once, at startup",
    "enable_offline_docs": "serve has no vendored offline docs",
    "enable_flash_late_interaction": "serve serves no pooling models",
}
"""`vllm serve`'s server flags (and its parser's own) that `serve` refuses, each with why."""


@dataclass(frozen=True)
class FrontendOptions:
    """vLLM's server flags `serve` takes, each with vLLM's name, default and meaning:

    - the chat responses' role when `add_generation_prompt` is true (`response_role`); the
      server-wide default of the request field `return_tokens_as_token_ids`;
      `usage.prompt_tokens_details.cached_tokens` (`enable_prompt_tokens_details`); usage in
      every stream, on every chunk, as if each asked `stream_options.include_usage` and
      `continuous_usage_stats` (`enable_force_include_usage`);
    - the chat template: `default_chat_template_kwargs` under the request's own, a request's
      own `chat_template` taken (`trust_request_chat_template`), no tools rendered when
      `tool_choice` is `none` (`exclude_tools_when_tool_choice_none`), each message's content
      as one text or a list of parts (`chat_template_content_format`,
      `server.chat_messages`);
    - reasoning: vLLM's reasoning parser (`reasoning_parser`; empty: none), an engine flag that
      vLLM's server reads too (the engine gets it among `engine_flag_overrides`), and the
      module or file that registers one (`reasoning_parser_plugin`, imported first);
    - HTTP: no `/docs`, `/redoc`, `/openapi.json` (`disable_fastapi_docs`), `X-Request-Id` on
      every response (`enable_request_id_headers`), the ASGI `middleware` added (import paths),
      and uvicorn's unix socket (`uds`: host and port ignored), TLS ciphers, h11 limits and
      access log filter (`disable_access_log_for_endpoints`), as `vllm serve` passes them.
    """

    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    trust_request_chat_template: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: ContentFormatOption = "auto"
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    disable_fastapi_docs: bool = False
    enable_request_id_headers: bool = False
    middleware: tuple[str, ...] = ()
    uds: str | None = None
    ssl_ciphers: str | None = None
    h11_max_incomplete_event_size: int = 4194304
    h11_max_header_count: int = 256
    disable_access_log_for_endpoints: str | None = None


_FRONTEND = frozenset(f.name for f in dataclasses.fields(FrontendOptions))


def engine_flag_overrides(flags: str) -> dict[str, Any]:
    """The engine arguments ``flags`` (a shell-quoted string of `vllm serve`'s flags) set, by
    field name, each a value vLLM's parser made. Raises ValueError, one line, for what
    `serve` refuses (module docstring)."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 (after the environment)

    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return {name: value for name, value in _given(flags).items() if name in engine}


def frontend_options(flags: str) -> FrontendOptions:
    """The server flags ``flags`` (a shell-quoted string of `vllm serve`'s flags) set, with
    vLLM's defaults for the others. Raises ValueError, one line, for what `serve` refuses
    (module docstring), a `--default-chat-template-kwargs` that is not a JSON object, a
    `--middleware` that cannot be imported or is neither a class nor a coroutine function, a
    `--reasoning-parser-plugin` that cannot be imported and a `--reasoning-parser` vLLM does
    not know (with that plugin imported)."""
    given = {name: value for name, value in _given(flags).items() if name in _FRONTEND}
    if plugin := given.get("reasoning_parser_plugin"):
        _import_plugin(plugin)
    if name := given.get("reasoning_parser"):
        _check_reasoning_parser(name)
    kwargs = given.get("default_chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"--default-chat-template-kwargs must be a JSON object, not {kwargs!r}")
    if "middleware" in given:
        given["middleware"] = tuple(given["middleware"])
        for path in given["middleware"]:
            middleware(path)
    return FrontendOptions(**given)


def middleware(path: str) -> Any:
    """The ASGI middleware class or the HTTP middleware coroutine function at import path
    `path` (``module.name``), as vLLM's server imports its ``--middleware``; ValueError, one
    line, when it cannot be imported or is neither."""
    module_path, _, name = path.rpartition(".")
    try:
        imported = getattr(importlib.import_module(module_path), name)
    except Exception as error:  # whatever the user's module raises while it is imported
        raise ValueError(f"--middleware {path}: cannot be imported: {error!r}") from None
    if not (inspect.isclass(imported) or inspect.iscoroutinefunction(imported)):
        raise ValueError(f"Invalid middleware {path}. Must be a function or a class.")
    return imported


def _import_plugin(path: str) -> None:
    """Import `path` (a Python file, else a module) as vLLM imports a
    ``--reasoning-parser-plugin``; ValueError, one line, when it cannot be."""
    from vllm.utils.import_utils import import_from_path  # noqa: PLC0415

    try:
        if path.endswith(".py"):
            import_from_path(Path(path).stem, path)
        else:
            importlib.import_module(path)
    except Exception as error:  # whatever the user's module raises while it is imported
        message = f"--reasoning-parser-plugin {path}: cannot be imported: {error!r}"
        raise ValueError(message) from None


def _check_reasoning_parser(name: str) -> None:
    """ValueError, vLLM's message in one line, for a reasoning parser vLLM's
    `ReasoningParserManager` does not know."""
    from vllm.reasoning import ReasoningParserManager  # noqa: PLC0415

    known = ReasoningParserManager.list_registered()
    if name not in known:
        raise ValueError(f"invalid reasoning parser: {name} (chose from {{ {','.join(known)} }})")


def _given(flags: str) -> dict[str, Any]:
    """Every field ``flags`` sets to other than its default, by name, as `vllm serve`'s parser
    reads them; ValueError, one line, for what `serve` refuses."""
    try:
        words = shlex.split(flags)
    except ValueError as error:
        raise ValueError(f"vLLM flags: {error}") from error
    if not words:
        return {}
    parser = _serve_parser()
    try:
        parsed, unknown = parser.parse_known_args(words)
    except (argparse.ArgumentError, ValueError, TypeError) as error:
        raise ValueError(f"vLLM flags: {error}") from error
    if unknown:
        raise ValueError(f"not a flag of vllm serve nor of serve: {' '.join(unknown)}")
    defaults = _serve_defaults()
    given = {name: value for name, value in vars(parsed).items() if value != defaults[name]}
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        if name in Settings.model_fields:
            raise ValueError(f"{flag} is a setting of serve: give it as {flag}, not among vLLM's")
        if name in _SET_BY_SERVE:
            raise ValueError(f"{flag} is set by serve itself and cannot be given")
        if name in NOT_TAKEN:
            shown = repr(value) if name == "model_tag" else flag
            raise ValueError(f"{shown}: {NOT_TAKEN[name]}")
    return given


@functools.cache
def _serve_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s own parser (`make_arg_parser`), built once, raising ValueError where it
    would print its usage and exit."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ValueError(message)

    return make_arg_parser(Parser(add_help=False, exit_on_error=False))


@functools.cache
def _serve_defaults() -> dict[str, Any]:
    """Every field of `_serve_parser` with its default."""
    return vars(_serve_parser().parse_args([]))
