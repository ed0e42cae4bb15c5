"""`POST /tokenize`, `POST /detokenize` and `GET /version`, as vLLM's OpenAI server answers
them (vllm/entrypoints/serve/tokenize, serve/instrumentator/basic.py).

`/tokenize` takes a `prompt` (special tokens added unless `add_special_tokens` is false) or
chat `messages`, rendered by the model's chat template as `/v1/chat/completions` renders them,
with vLLM's chat-template fields and their meaning (`server.vllm_fields.ChatTemplateFields`:
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, `tools`,
`add_special_tokens`; a request `chat_template` taken only with
``--trust-request-chat-template`` and multimodal kwargs refused, as vLLM's), and answers the
token ids, their count, the context length and, with `return_token_strs`, the tokens' strings;
`/detokenize` answers the text of token ids. An unknown `model` is a 404, as on the generation
routes. Like vLLM's server, these routes and `/version` (vLLM's version) are outside `/v1/`,
so they never need the API key.

Fields a body does not define are ignored, as vLLM's server ignores them; `nts_*` keys too:
these routes take none of ours, so a chat request's body, keys of ours included, tokenizes as
its messages.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from starlette.concurrency import run_in_threadpool
from vllm import __version__ as VLLM_VERSION  # noqa: N812

from noisy_temp_server.server.adapter import check_model
from noisy_temp_server.server.chat import chat_prompt
from noisy_temp_server.server.chat_messages import ChatMessage
from noisy_temp_server.server.errors import OpenAIError
from noisy_temp_server.server.state import ServerState, ServerStateDep
from noisy_temp_server.server.vllm_fields import ChatTemplateFields

__all__ = [
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "VersionResponse",
    "router",
]

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(ChatTemplateFields, _Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    return_token_strs: StrictBool | None = False

    @model_validator(mode="after")
    def _text_parts_only(self) -> TokenizeChatRequest:
        for message in self.messages:
            message.text()  # a ValueError (400) for non-text parts, as on /v1/chat/completions
        return self


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


class DetokenizeResponse(_Strict):
    prompt: str


class VersionResponse(_Strict):
    version: str


def _token_ids(state: ServerState, request: TokenizeCompletionRequest | TokenizeChatRequest) -> Any:
    if isinstance(request, TokenizeCompletionRequest):
        return state.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    return chat_prompt(state, request.messages, request)[1]


@router.post("/tokenize")
async def tokenize(
    request: TokenizeCompletionRequest | TokenizeChatRequest, state: ServerStateDep
) -> TokenizeResponse:
    """The token ids of a prompt, or of chat messages rendered by the chat template."""
    check_model(state, request.model)
    try:
        ids = [int(i) for i in await run_in_threadpool(_token_ids, state, request)]
    except (OverflowError, TypeError, ValueError) as error:  # the tokenizer's refusal
        raise OpenAIError(f"The prompt could not be tokenized: {error}", status_code=400) from None
    strings = None
    if request.return_token_strs:
        strings = [str(s) for s in state.tokenizer.convert_ids_to_tokens(ids)]
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strings
    )


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, state: ServerStateDep) -> DetokenizeResponse:
    """The text of token ids (special tokens kept, as vLLM's server)."""
    check_model(state, request.model)
    try:
        text = await run_in_threadpool(state.tokenizer.decode, list(request.tokens))
    except (OverflowError, IndexError, TypeError, ValueError) as error:
        raise OpenAIError(
            f"The tokens could not be decoded: {error}", status_code=400, param="tokens"
        ) from None
    return DetokenizeResponse(prompt=str(text))


@router.get("/version")
async def version() -> VersionResponse:
    """The version of vLLM serving the model (what vLLM's own server answers)."""
    return VersionResponse(version=VLLM_VERSION)
