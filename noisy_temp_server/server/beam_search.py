"""`use_beam_search` on `/v1/completions` and `/v1/chat/completions`: vLLM's own beam search
(`BeamSearchOnlineMixin.beam_search`, the code vLLM's server runs) over this server's engine.

vLLM's beam search samples nothing: for each beam it asks the engine for one token with the
`2 n` best logprobs, and ranks the beams by their summed logprobs (vLLM's default raw logprobs:
the model's own, whatever the temperature). Here each of those step requests is greedy (the
request's `BeamSearchParams` have temperature 0) and carries the request's `nts_*` keys, so the
temperature processor leaves its row alone and the logprobs the beams are ranked by are the
served model's own (with the policy's per-token bias, as every greedy request gets it), as on
vLLM's server, whether or not this server returns tuned logprobs (`tuned_logprobs`). So T*
does not apply to a beam search: its `nts` object says rule `off` and T* = 1, and it is never
shadow-sampled (a greedy request).

Each prompt is one search of `n` beams; its `n` best beams are the prompt's `n` choices, in
vLLM's order (best first).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
from vllm.inputs import tokens_input
from vllm.outputs import RequestOutput
from vllm.utils.async_utils import merge_async_iterators

from noisy_temp_server.engine_contract.keys import KEY_PREFIX
from noisy_temp_server.server.errors import OpenAIError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import BeamSearchParams, SamplingParams

    from noisy_temp_server.server.engine import GenerationEngine

__all__ = ["beam_search_outputs"]


class _StepEngine:
    """The engine as vLLM's beam search calls it (its `engine_client`): each one-token step
    request goes to the engine with the request's `nts_*` keys and its engine arguments
    (`priority`). vLLM's `trace_headers` and `session_id` are None here (this server has
    neither)."""

    def __init__(
        self,
        engine: GenerationEngine,
        extra_args: Mapping[str, Any],
        engine_kwargs: Mapping[str, Any],
    ) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self.extra_args = dict(extra_args)
        self.engine_kwargs = engine_kwargs

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        sampling_params.extra_args = dict(self.extra_args)
        return self.engine.generate(
            prompt, sampling_params, request_id, lora_request=lora_request, **self.engine_kwargs
        )


class _Renderer:
    """What vLLM's beam search reads of its renderer: the tokenizer (its `eos_token_id`, and
    `decode` for the beams' text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer


class _BeamSearch(BeamSearchOnlineMixin):
    def __init__(self, engine_client: Any, renderer: Any) -> None:
        self.engine_client = engine_client
        self.renderer = renderer


async def beam_search_outputs(
    engine: GenerationEngine,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    choice_params: Sequence[SamplingParams],
    beam: BeamSearchParams,
    *,
    request_id: str,
    lora_request: LoRARequest | None = None,
    prompt_kwargs: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Each prompt's beam search, run concurrently: yields `(choice index, output)` for the
    `beam.beam_width` best beams of prompt `p` (choices `p n` to `p n + n - 1`, best first),
    each a finished output of that one beam, as `server.serving` takes one engine request's.
    `choice_params`: the request's per-choice parameters (the prompt's budget is its first
    choice's `max_tokens`; the step requests carry its `nts_*` keys; the beams' logprobs,
    which vLLM's search always computes, are kept only when they ask for logprobs)."""
    n = beam.beam_width
    with_logprobs = choice_params[0].logprobs is not None
    search = _BeamSearch(
        _StepEngine(engine, _nts_keys(choice_params[0]), engine_kwargs or {}),
        _Renderer(tokenizer),
    )
    searches = [
        search.beam_search(
            tokens_input(ids, **(prompt_kwargs or {})),
            f"{request_id}-{p}",
            msgspec.structs.replace(beam, max_tokens=choice_params[p * n].max_tokens or 1),
            lora_request=lora_request,
        )
        for p, ids in enumerate(prompts)
    ]
    async for p, output in _overflow_is_the_requests(merge_async_iterators(*searches)):
        for best in output.outputs:
            if not with_logprobs:
                best.logprobs = None
            yield (
                p * n + best.index,
                RequestOutput(
                    output.request_id, output.prompt, output.prompt_token_ids, None, [best], True
                ),
            )


def _nts_keys(params: SamplingParams) -> dict[str, Any]:
    return {k: v for k, v in (params.extra_args or {}).items() if k.startswith(KEY_PREFIX)}


async def _overflow_is_the_requests(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """`outputs`; an `OpenAIError` (400) for the `OverflowError` vLLM's beam search raises when
    it ranks beams with a `length_penalty` too large for a float (its server's answer: 400)."""
    try:
        async for item in outputs:
            yield item
    except OverflowError as error:
        raise OpenAIError(
            f"The beams' scores overflow ({error}): give a smaller length_penalty.",
            param="length_penalty",
        ) from None
