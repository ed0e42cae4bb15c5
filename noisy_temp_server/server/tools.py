"""Tool calling on `/v1/chat/completions` as vLLM's OpenAI server does it, with vLLM's own
parsers.

`serve --tool-call-parser NAME --enable-auto-tool-choice true` mean what the two flags mean for
`vllm serve`: `tool_parser_class` takes the parser from vLLM's `ParserManager` (the
`ToolParserManager` registry) at startup and checks it against the tokenizer, and, as in vLLM,
there is a parser only with both flags. The request's `tools` are rendered by the chat template
(`tools`), and then, as vLLM's serving does:

- no parser: `tool_choice` `auto` is a 400 (it needs both flags), `required` and a named
  function too (they need the parser); `none` (the default) renders the tools and parses nothing;
- `auto`: the parser finds the calls in the generated text (`finish_reason` `tool_calls` when
  it found one);
- `required` / named, with a parser that takes them (`supports_required_and_named`): the
  parser's `adjust_request` constrains the output to vLLM's JSON tool-call schema (a structured
  output: T* and the bias reshape only the tokens it allows, and such choices are never
  shadow-sampled) and parses the JSON back into `tool_calls`.

The parser works on vLLM's own request model: `ToolCalls` builds vLLM's `ChatCompletionRequest`
from ours (the `nts_*` keys left out; a body vLLM's model refuses is a 400, as on vLLM's
server) once per request with tools and a parser, and one parser per choice (parsers keep
state while a stream goes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from vllm.entrypoints.generate.base.protocol import ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.renderers.chat_utils import make_tool_call_id

from noisy_temp_server.server.errors import OpenAIError

if TYPE_CHECKING:
    from vllm.entrypoints.generate.base.protocol import DeltaToolCall
    from vllm.parser.abstract_parser import Parser

    from noisy_temp_server.server.protocol import ChatCompletionRequest
    from noisy_temp_server.server.state import ChatTokenizer
    from noisy_temp_server.settings import Settings

__all__ = ["ToolCalls", "tool_parser_class"]


def tool_parser_class(settings: Settings, tokenizer: Any, model_name: str) -> type[Parser] | None:
    """vLLM's parser class for `--tool-call-parser` (None without it or without
    `--enable-auto-tool-choice`, as in vLLM). Raises `TypeError` with vLLM's message for a name
    vLLM does not know or a parser the tokenizer cannot serve."""
    from vllm.parser.parser_manager import ParserManager  # noqa: PLC0415  (vLLM's registries)

    return ParserManager.get_parser(
        tool_parser_name=settings.tool_call_parser,
        enable_auto_tools=settings.enable_auto_tool_choice,
        model_name=model_name,
        tokenizer=tokenizer,
    )


class ToolCalls:
    """One chat request's tool calling (module docstring): its checks, the constraint it puts
    on the request, the tools the template renders, and the parsing of each choice's text."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        parser_class: type[Parser] | None,
        tokenizer: ChatTokenizer,
        *,
        auto_tools: bool,
    ) -> None:
        """Raises `OpenAIError` (400, vLLM's message) for a `tool_choice` the server cannot
        honour; constrains `request` for `required` / named."""
        self.request = request
        self.parser_class = parser_class
        self.tokenizer = tokenizer
        self.auto_tools = auto_tools
        self._refuse_unserved_choice()
        self._parsers: dict[int, Parser] = {}
        self.streamed: set[int] = set()
        if request.tools or request.tool_choice not in (None, "none"):
            self.vllm_request = _vllm_request(request)  # vLLM's checks of tools apply
        if self.active:
            adjusted: Any = self.parser(-1).adjust_request(self.vllm_request)  # a chat request
            self.vllm_request = adjusted
            request.constrain(self.vllm_request.extract_structured_outputs())

    @property
    def active(self) -> bool:
        """Whether the generated text is parsed for tool calls."""
        return self.parser_class is not None and bool(self.request.tools)

    @property
    def named(self) -> bool:
        return isinstance(self.request.tool_choice, ChatCompletionNamedToolChoiceParam)

    def _refuse_unserved_choice(self) -> None:
        choice = self.request.tool_choice
        if self.parser_class is not None or choice in (None, "none"):
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
            self._parsers[index] = self.parser_class(tokenizer, tools)
        return self._parsers[index]

    def parse(
        self, index: int, text: str, token_ids: list[int], finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """A finished choice's content, tool calls and finish reason, as vLLM's serving makes
        them from the parser's result."""
        if not self.active:
            return text, [], finish_reason
        _, content, calls = self.parser(index).parse(
            text, self.vllm_request, enable_auto_tools=self.auto_tools,
            model_output_token_ids=token_ids,
        )  # fmt: skip
        tool_calls = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls or []]
        required = self.request.tool_choice == "required"
        if self.named or required:
            content = content or ""
        called = (bool(tool_calls) and self.request.tool_choice in ("auto", None)) or (
            required and finish_reason == "stop"
        )
        return content, tool_calls, "tool_calls" if called else finish_reason

    def parse_delta(
        self, index: int, text: str, token_ids: list[int], prompt: list[int], *, finished: bool
    ) -> tuple[str | None, list[DeltaToolCall]]:
        """What one stream step adds to choice `index`: content and tool-call deltas."""
        if not self.active:
            return text, []
        delta = self.parser(index).parse_delta(
            text, token_ids, self.vllm_request, prompt, finished=finished
        )
        if delta is None:
            return None, []
        if delta.tool_calls:
            self.streamed.add(index)
        return delta.content, list(delta.tool_calls)

    def stream_finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """A streamed choice's finish reason: `tool_calls` when it streamed calls (not for a
        named function), as vLLM's stream says."""
        if finish_reason is not None and index in self.streamed and not self.named:
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
