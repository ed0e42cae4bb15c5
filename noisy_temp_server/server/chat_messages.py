"""Chat messages as the chat template receives them, as vLLM's renderer hands them over
(`vllm.renderers.chat_utils.parse_chat_messages`), in the content format of
``--chat-template-content-format`` (vLLM's flag and meaning):

- `string`: each message's content is one text, its text parts joined by newlines;
- `openai`: each message's content is the list of its text parts (`{"type": "text", "text":
  ...}`; a plain string is one part), but a tool message's, whose text parts are joined as in
  `string` (vLLM's);
- `auto` (the default): `openai` when the template loops over a message's content, else
  `string`, by vLLM's own detection on the template (`vllm.renderers.hf`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
from vllm.renderers.hf import _detect_content_format

__all__ = ["ChatMessage", "ContentFormat", "ContentFormatOption", "content_format"]

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
        """The message as the chat template takes it: its content in `content_format` (module
        docstring), with its other keys (such as an assistant's `tool_calls` or a tool's
        `tool_call_id`); an assistant's `reasoning` (or `reasoning_content`, its old name) under
        both names, and no other message's, as vLLM's renderer hands them over."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in _REASONING_KEYS}
        message: dict[str, Any] = {**extra, "role": self.role}
        parts = self.text_parts()
        if content_format == "openai" and self.role != "tool":
            message["content"] = [{"type": "text", "text": text} for text in parts]
        else:
            message["content"] = "\n".join(parts)
        reasoning = next(
            (r for r in (getattr(self, k, None) for k in _REASONING_KEYS) if r is not None), None
        )
        if self.role == "assistant" and reasoning is not None:
            message |= dict.fromkeys(_REASONING_KEYS, reasoning)
        return message

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
