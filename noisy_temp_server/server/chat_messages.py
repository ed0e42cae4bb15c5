"""Chat messages as the chat template receives them, as vLLM's renderer hands them over
(`vllm.renderers.chat_utils.parse_chat_messages`), in the content format of
``--chat-template-content-format`` (vLLM's flag and meaning):

- `string`: each message's content is one text, its text parts joined by newlines;
- `openai`: each message's content is the list of its text parts (`{"type": "text", "text":
  ...}`; a plain string is one part), but a tool message's, whose text parts are joined as in
  `string` (vLLM's);
- `auto` (the default): `openai` when the template loops over a message's content, else
  `string`, by vLLM's own detection on the template (`vllm.renderers.hf`).

Besides its role and content, a message reaches the template with only the keys vLLM's
renderer passes (`_parse_chat_message_content`), and its tool calls' arguments as objects
(vLLM's `_postprocess_messages`): `template_messages`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
from vllm.renderers.chat_utils import _postprocess_messages, _strip_claude_code_billing_header
from vllm.renderers.hf import _detect_content_format

__all__ = [
    "ChatMessage",
    "ContentFormat",
    "ContentFormatOption",
    "content_format",
    "template_messages",
]

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]
_REASONING_KEYS = ("reasoning", "reasoning_content")


def content_format(option: ContentFormatOption, template: Any) -> ContentFormat:
    """The content format `template` receives messages in: `option`, or for `auto` the one
    vLLM detects on the template (`openai` when it loops over a message's content; `string`
    for no template or one that is not a text, as vLLM's)."""
    if option != "auto":
        return option
    if not isinstance(template, str):
        return "string"
    return _detect_content_format(template, default="string")


def template_messages(
    messages: Sequence[ChatMessage], content_format: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """`messages` as the chat template takes them (`ChatMessage.template_message`), then as
    vLLM's `_postprocess_messages` leaves them: each assistant tool call's `arguments` an
    object (a JSON text parsed; empty, or not a JSON object: `{}`), an empty `tool_calls`
    dropped. Raises vLLM's `VLLMValidationError` (its 400) for a tool call that is not an
    object of type `function`."""
    rendered = [message.template_message(content_format) for message in messages]
    _postprocess_messages(rendered)  # type: ignore[arg-type]  # vLLM types them its TypedDict
    return rendered


class ChatMessage(BaseModel):
    """One chat message. Content may be a string or a list of text parts; null only for an
    assistant message (as OpenAI)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"content of a {self.role} message must be a string or a list of text parts, "
                "not null (only an assistant message may have null content)."
            )
        return self

    def template_message(self, content_format: ContentFormat = "string") -> dict[str, Any]:
        """The message as vLLM's renderer hands it to the chat template: its role, its content
        in `content_format` (module docstring; a system message's text without Claude Code's
        billing-header line, as vLLM strips it), and of its other keys only those vLLM passes:
        an assistant's `tool_calls` (unless null; a copy) and `reasoning` (or
        `reasoning_content`, its old name) under both names, a tool's `tool_call_id`, any
        message's `name` and `task` when they are texts, a developer's `tools` (null when
        absent)."""
        extra = self.model_extra or {}
        message: dict[str, Any] = {"role": self.role, "content": self._content(content_format)}
        if self.role == "assistant":
            if extra.get("tool_calls") is not None:
                message["tool_calls"] = copy.deepcopy(extra["tool_calls"])
            reasoning = next((r for r in map(extra.get, _REASONING_KEYS) if r is not None), None)
            if reasoning is not None:
                message |= dict.fromkeys(_REASONING_KEYS, reasoning)
        elif self.role == "tool" and "tool_call_id" in extra:
            message["tool_call_id"] = extra["tool_call_id"]
        named = {"name": self.name, "task": extra.get("task")}
        message |= {key: value for key, value in named.items() if isinstance(value, str)}
        if self.role == "developer":
            message["tools"] = extra.get("tools")
        return message

    def _content(self, content_format: ContentFormat) -> str | list[dict[str, str]]:
        parts = self.text_parts()
        if self.role == "system":
            parts = _strip_claude_code_billing_header(parts)  # type: ignore[assignment]
        if content_format == "openai" and self.role != "tool":
            return [{"type": "text", "text": text} for text in parts]
        return "\n".join(parts)

    def text_parts(self) -> list[str]:
        """The message's text parts (a string content is one; null none); raises ValueError
        for non-text parts."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [self.content]
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported.")
            texts.append(part["text"])
        return texts

    def text(self) -> str:
        """The message's text: its text parts joined by newlines, as vLLM joins them."""
        return "\n".join(self.text_parts())
