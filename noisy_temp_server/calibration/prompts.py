"""The prompt set calibration generates from, and how a prompt becomes token ids.

The shipped set (`noisy_temp_server/data/prompts.jsonl`) holds short, varied user requests, one
JSON object per line: `{"id": "p000", "text": "..."}`. A custom set uses the same format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Prompt", "PromptSetError", "encode_prompt", "load_prompts"]


class PromptSetError(ValueError):
    """A prompt file that cannot be read or has a malformed line."""


@dataclass(frozen=True)
class Prompt:
    """One user request; `id` is unique within its set."""

    id: str
    text: str


def load_prompts(path: Path | None = None) -> list[Prompt]:
    """Prompts from a JSONL file (the shipped set when `path` is None), in file order.

    Raises `PromptSetError` naming the line for bad JSON, a missing or empty field, or a
    duplicate id.
    """
    if path is None:
        text = resources.files("noisy_temp_server").joinpath("data/prompts.jsonl").read_text()
        source = "the shipped prompt set"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise PromptSetError(f"cannot read prompt file {path}: {error}") from error
        source = str(path)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = Prompt(id=str(record["id"]), text=str(record["text"]))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise PromptSetError(
                f"{source}, line {number}: expected a JSON object with 'id' and 'text' ({error})"
            ) from error
        if not prompt.text or prompt.id in seen:
            raise PromptSetError(f"{source}, line {number}: empty text or duplicate id {prompt.id}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise PromptSetError(f"{source} holds no prompts")
    return prompts


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of `prompt` as the served model sees it: a one-turn chat with the generation
    prompt appended when the tokenizer has a chat template, the plain text otherwise."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in cast("list[int]", ids)]
    plain: list[int] = tokenizer(prompt.text)["input_ids"]
    return [int(i) for i in plain]
