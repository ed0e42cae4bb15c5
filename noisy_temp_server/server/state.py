"""The server's state: everything a handler needs, built once by `create_app`.

`ServerState` is stored on the app (`app.state.server`); handlers receive it through the
`ServerStateDep` dependency, never from globals or closures, so a test can build one with fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Protocol, cast

from fastapi import Depends, FastAPI, Request

from noisy_temp_server.server.vllm_flags import FrontendOptions

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from vllm.parser.abstract_parser import Parser

    from noisy_temp_server.adapter.serving import ServedAdapter
    from noisy_temp_server.engine_contract.trace_channel import TraceSource
    from noisy_temp_server.online.policy_source import PolicySource
    from noisy_temp_server.online.shadow import ShadowScorer
    from noisy_temp_server.server.engine import GenerationEngine
    from noisy_temp_server.server.metrics import ApiMetrics
    from noisy_temp_server.settings import Settings

__all__ = [
    "ChatTokenizer",
    "ServerState",
    "ServerStateDep",
    "attach_state",
    "server_state",
]


class ChatTokenizer(Protocol):
    """What the server needs of the served model's (Hugging Face) tokenizer."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str | list[str]: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool, **kwargs: Any
    ) -> Any: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> Any: ...


@dataclass(frozen=True)
class ServerState:
    """What the handlers share.

    `engine`: vLLM's `AsyncLLM` (or a fake with its interface); `policy_source`: the policy in force
    for new requests; `trace_source`: the per-step T* of tuned requests (None: tuned requests report
    no T statistics); `shadow`: the shadow scorer sampled choices are submitted to (None: no shadow
    scoring); `metrics`: the API metrics, registered where `metrics_registry` (what `/metrics`
    serves) sees them; `model_name`: the served model name clients must send; `max_model_len`: the
    context length prompts and completions share; `adapter`: the compensation adapter the served
    model id stands for with the model (None: none; `server.adapter`); `output_parser`: vLLM's
    parser class for reasoning and tool calls (None: none; `server.tools`); `sampling_defaults`: the
    model's sampling defaults as vLLM's server reads them (`ModelConfig.get_diff_sampling_param`:
    its `generation_config.json` under vLLM's default ``--generation-config auto``), for the fields
    a request leaves unset; `frontend`: vLLM's server flags given in the settings' ``vllm_args``
    (`server.vllm_flags`).
    """

    settings: Settings
    engine: GenerationEngine
    tokenizer: ChatTokenizer
    model_name: str
    max_model_len: int
    policy_source: PolicySource
    metrics: ApiMetrics
    metrics_registry: CollectorRegistry
    trace_source: TraceSource | None
    shadow: ShadowScorer | None
    adapter: ServedAdapter | None = None
    output_parser: type[Parser] | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    frontend: FrontendOptions = field(default_factory=FrontendOptions)


def attach_state(app: FastAPI, state: ServerState) -> None:
    """Make `state` what `server_state` returns for the requests of `app`."""
    app.state.server = state


def server_state(request: Request) -> ServerState:
    """The FastAPI dependency giving a handler the state of its app."""
    return cast("ServerState", request.app.state.server)


ServerStateDep = Annotated[ServerState, Depends(server_state)]
