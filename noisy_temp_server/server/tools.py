"""Reasoning and tool calling on `/v1/chat/completions` as vLLM's OpenAI server does them, with
vLLM's own parsers.

`serve --tool-call-parser NAME --enable-auto-tool-choice true` and ``--reasoning-parser NAME``
(among vLLM's flags) mean what they mean for `vllm serve`: `output_parser_class` composes vLLM's
`Parser` from the two (vLLM's `ParserManager`: its `ToolParserManager` and
`ReasoningParserManager` registries) at startup and checks it against the tokenizer; as in
vLLM, there is a tool parser only with both tool flags.

Reasoning: each choice's text is split into its `reasoning` and its content (the tool calls are
parsed from the content, after the reasoning), streams too (`reasoning` deltas), as vLLM's
serving splits them. A request with `include_reasoning: false` gets no reasoning, and then,
as on vLLM's server, no logprobs nor token ids either (they would carry it). The engine gets
the reasoning parser as vLLM's does (``--reasoning-parser`` is an engine flag too: its
structured outputs apply only after the reasoning ends), and with each request whether the
reasoning has ended already (`engine_kwargs`).

Tools: the request's `tools` are rendered by the chat template, and then, as vLLM's serving:

- no tool parser: `tool_choice` `auto` is a 400 (it needs both flags), `required` and a named
  function too (they need the parser); `none` (the default) renders the tools and parses
  nothing;
- `auto`: the parser finds the calls in the generated text (`finish_reason` `tool_calls` when
  it found one);
- `required` / named, with a parser that takes them (`supports_required_and_named`): the
  parser's `adjust_request` constrains the output to vLLM's JSON tool-call schema (a structured
  output: T* and the bias reshape only the tokens it allows, and such choices are never
  shadow-sampled) and parses the JSON back into `tool_calls`.

The parsers work on vLLM's own request model: `ChatOutputParsing` builds vLLM's
`ChatCompletionRequest` from ours (the `nts_*` keys left out; a body vLLM's model refuses is a
400, as on vLLM's server) once per request that has a parser to run, and one parser per choice
(parsers keep state while a stream goes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from vllm.entrypoints.generate.base.protocol import DeltaMessage, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
from vllm.renderers.chat_utils import make_tool_call_id

from noisy_temp_server.server.errors import OpenAIError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from vllm.parser.abstract_parser import Parser

    from noisy_temp_server.server.protocol import ChatCompletionRequest
    from noisy_temp_server.server.serving import Choice
    from noisy_temp_server.server.state import ChatTokenizer
    from noisy_temp_server.settings import Settings

__all__ = ["ChatOutputParsing", "output_parser_class"]


def output_parser_class(
    settings: Settings, reasoning_parser: str, tokenizer: Any, model_name: str
) -> type[Parser] | None:
    """vLLM's parser class for `--tool-call-parser` (none without it or without
    `--enable-auto-tool-choice`, as in vLLM) and `reasoning_parser` (``--reasoning-parser``;
    empty: none); None when neither. Raises `TypeError` with vLLM's message for a name vLLM
    does not know or a parser the tokenizer cannot serve."""
    from vllm.parser.parser_manager import ParserManager  # noqa: PLC0415  (vLLM's registries)

    return ParserManager.get_parser(
        tool_parser_name=settings.tool_call_parser,
        reasoning_parser_name=reasoning_parser or None,
        enable_auto_tools=settings.enable_auto_tool_choice,
        model_name=model_name,
        tokenizer=tokenizer,
    )


class ChatOutputParsing:
    """One chat request's parsing of its choices' text (module docstring): its checks, the
    constraint it puts on the request, and the split of each choice's text into reasoning,
    content and tool calls."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        parser_class: type[Parser] | None,
        tokenizer: ChatTokenizer,
        *,
        auto_tools: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Raises `OpenAIError` (400, vLLM's message) for a `tool_choice` the server cannot
        honour; constrains `request` for `required` / named. `template_kwargs`: what the chat
        template renders the request with (the parsers of some models read them)."""
        self.request = request
        self.parser_class = parser_class
        self.tokenizer = tokenizer
        self.auto_tools = auto_tools
        self.template_kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "tools"}
        self.tool_parser_class = None if parser_class is None else parser_class.tool_parser_cls
        self.reasons = parser_class is not None and parser_class.reasoning_parser_cls is not None
        self._refuse_unserved_choice()
        self._parsers: dict[int, Parser] = {}
        self.streamed: set[int] = set()
        if self.reasons or request.tools or request.tool_choice not in (None, "none"):
            self.vllm_request = _vllm_request(request)  # vLLM's checks of tools apply
        if self.reasons or self.parses_tools:
            adjusted: Any = self.parser(-1).adjust_request(self.vllm_request)  # a chat request
            self.vllm_request = adjusted
        if self.parses_tools:
            request.constrain(self.vllm_request.extract_structured_outputs())

    @property
    def parses_tools(self) -> bool:
        """Whether the generated text is parsed for tool calls."""
        return self.tool_parser_class is not None and bool(self.request.tools)

    @property
    def parses(self) -> bool:
        """Whether the generated text is parsed at all (reasoning or tool calls)."""
        return self.reasons or self.parses_tools

    @property
    def hides_metadata(self) -> bool:
        """Whether the choices' logprobs and token ids are left out: the request asked for no
        reasoning from a server with a parser (vLLM's: they would show it)."""
        return self.parser_class is not None and not self.request.include_reasoning

    @property
    def named(self) -> bool:
        return isinstance(self.request.tool_choice, ChatCompletionNamedToolChoiceParam)

    def _refuse_unserved_choice(self) -> None:
        choice = self.request.tool_choice
        if self.tool_parser_class is not None or choice in (None, "none"):
            return
        if choice == "auto":
            message = (
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        else:
            wanted = (
                f'"{choice}"' if isinstance(choice, str) else f'function "{choice.function.name}"'
            )
            message = f"tool_choice={wanted} requires --tool-call-parser to be set"
        raise OpenAIError(message, status_code=400, param="tool_choice")

    def parser(self, index: int) -> Parser:
        """Choice `index`'s parser (made on first use)."""
        if index not in self._parsers:
            assert self.parser_class is not None
            tokenizer: Any = self.tokenizer
            tools: Any = self.vllm_request.tools
            self._parsers[index] = self.parser_class(
                tokenizer, tools, chat_template_kwargs=self.template_kwargs
            )
        return self._parsers[index]

    def engine_kwargs(self, prompt: list[int]) -> dict[str, Any]:
        """What vLLM's serving passes the engine's `generate` with a reasoning parser: whether
        the reasoning has ended already (by the prompt `prompt`, or true without reasoning
        asked), and the parser's arguments; nothing without one."""
        if not self.reasons:
            return {}
        return {
            "reasoning_ended": self.vllm_request.resolve_reasoning_ended(self.parser(-1), prompt),
            "reasoning_parser_kwargs": {"chat_template_kwargs": self.template_kwargs},
        }

    def reasoning_tokens(self, choices: Sequence[Choice]) -> int | None:
        """The generated tokens inside the reasoning of `choices`, by their parsers' count
        (vLLM's `usage.completion_tokens_details.reasoning_tokens`); None without a reasoning
        parser."""
        if not self.reasons:
            return None
        return sum(self.parser(c.index).count_reasoning_tokens(c.token_ids) for c in choices)

    def parse(
        self, index: int, text: str, token_ids: list[int], prompt: list[int], finish: str | None
    ) -> tuple[str | None, str | None, list[ToolCall], str | None]:
        """A finished choice's reasoning (None unless `include_reasoning`), content, tool calls
        (the first only with `parallel_tool_calls: false`, vLLM's
        `maybe_filter_parallel_tool_calls`) and finish reason, as vLLM's serving makes them from
        the parser's result."""
        if not self.parses:
            return None, text, [], finish
        parser = self.parser(index)
        parser.set_prompt_token_ids(prompt)
        reasoning, content, calls = parser.parse(
            text, self.vllm_request, enable_auto_tools=self.auto_tools,
            model_output_token_ids=token_ids,
        )  # fmt: skip
        if not self.request.include_reasoning:
            reasoning = None
        if not self.parses_tools:
            return reasoning, content, [], finish
        kept = maybe_filter_parallel_tool_calls(list(calls or []), self.vllm_request)
        tool_calls = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in kept]
        required = self.request.tool_choice == "required"
        if self.named or required:
            content = content or ""
        called = (bool(tool_calls) and self.request.tool_choice in ("auto", None)) or (
            required and finish == "stop"
        )
        return reasoning, content, tool_calls, "tool_calls" if called else finish

    def parse_delta(
        self, index: int, text: str, token_ids: list[int], prompt: list[int], *, finished: bool
    ) -> DeltaMessage | None:
        """What one stream step adds to choice `index`: reasoning (none unless
        `include_reasoning`), content and tool-call deltas (those of the first call only with
        `parallel_tool_calls: false`, as vLLM's stream filters them: by the delta's `index`);
        None when it adds nothing to show (the parser holds it back, or it is reasoning not
        asked for)."""
        if not self.parses:
            return DeltaMessage(content=text)
        delta = self.parser(index).parse_delta(
            text, token_ids, self.vllm_request, prompt, finished=finished
        )
        if delta is not None and delta.tool_calls:
            self.streamed.add(index)  # before the filter, as vLLM's `tools_streamed`
            delta = maybe_filter_parallel_tool_calls(delta, self.vllm_request)
        return delta

    def stream_finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """A streamed choice's finish reason: `tool_calls` when the engine's is `stop` and the
        choice streamed calls (not for a named function), as vLLM's stream says; any other
        (`length`: the calls may be cut short) as the engine gave it."""
        if finish_reason == "stop" and index in self.streamed and not self.named:
            return "tool_calls"
        return finish_reason


def _vllm_request(request: ChatCompletionRequest) -> VllmChatRequest:
    """vLLM's own request model of `request` (what its parsers read); a 400 naming the first
    problem when vLLM's model refuses the body, as vLLM's server would."""
    try:
        return VllmChatRequest.model_validate(request.vllm_fields())
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise OpenAIError(
            f"vLLM's chat request refuses {where}: {first['msg']}", status_code=400
        ) from None
