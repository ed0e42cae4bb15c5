"""The `usage` object of the generation responses, as vLLM's server reports it: the token counts
(each prompt counted once), `prompt_tokens_details.cached_tokens` with
``--enable-prompt-tokens-details`` (the prompt tokens the engine found in its prefix cache),
`completion_tokens_details.reasoning_tokens` with ``--reasoning-parser`` (chat), and in streams
where vLLM's `should_include_usage` puts it (``stream_options``, or every stream with
``--enable-force-include-usage``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.entrypoints.serve.utils.api_utils import should_include_usage

from noisy_temp_server.server.response_bodies import (
    CompletionTokensDetails,
    PromptTokensDetails,
    Usage,
)

if TYPE_CHECKING:
    from noisy_temp_server.server.serving import Choice, GenerationRequest, PreparedRequest
    from noisy_temp_server.server.state import ServerState

__all__ = ["reported_cached_tokens", "stream_usage", "usage", "usage_so_far"]


def usage(
    prepared: PreparedRequest,
    *,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
) -> Usage:
    """The token counts of the request so far (all choices; each prompt counted once), with
    `prompt_tokens_details` when `cached_tokens` is given and `completion_tokens_details` when
    `reasoning_tokens` is."""
    completion = sum(len(c.token_ids) for c in prepared.choices)
    prompt = sum(len(ids) for ids in prepared.prompts)
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
        completion_tokens_details=_completion_details(reasoning_tokens),
    )


def usage_so_far(
    prepared: PreparedRequest, choice: Choice, *, reasoning_tokens: int | None = None
) -> Usage:
    """`choice`'s usage so far, as a stream's chunks report it with continuous usage: its
    prompt's tokens and the tokens it generated, with `completion_tokens_details` when
    `reasoning_tokens` is given."""
    prompt, completion = len(prepared.prompt_of(choice)), len(choice.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        completion_tokens_details=_completion_details(reasoning_tokens),
    )


def _completion_details(reasoning_tokens: int | None) -> CompletionTokensDetails | None:
    """`usage.completion_tokens_details` for `reasoning_tokens` (None: none)."""
    if reasoning_tokens is None:
        return None
    return CompletionTokensDetails(reasoning_tokens=reasoning_tokens)


def reported_cached_tokens(
    state: ServerState, prepared: PreparedRequest, choice: Choice | None = None
) -> int | None:
    """The cached prompt tokens `usage` reports: None without ``--enable-prompt-tokens-details``
    or when the engine reported none; else `choice`'s (a stream's: the first output's, as
    vLLM's), or the last prompt's first choice's (vLLM's full response: its last engine
    output's)."""
    if not state.frontend.enable_prompt_tokens_details:
        return None
    if choice is None:
        per_prompt = len(prepared.choices) // len(prepared.prompts)
        choice = prepared.choices[-per_prompt]
    return choice.cached_tokens


def stream_usage(state: ServerState, request: GenerationRequest) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk, and whether every chunk carries its choice's
    usage so far, as vLLM's `should_include_usage` decides."""
    options: Any = request.stream_options  # ours, with the fields vLLM's function reads
    return should_include_usage(options, state.frontend.enable_force_include_usage)
