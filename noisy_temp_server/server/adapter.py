"""The compensation adapter as the HTTP server serves it: which path is in force, and what each
request gets.

The served model id stands for the served model with the profile's adapter; every request gets
the adapter unless it turns it off. How it is served (`ServedAdapter.path`):

- ``folded``: folded into the served weights (float weights; `adapter.folded_checkpoint`): no
  per-step cost, and no request can turn it off, so ``nts_adapter: false`` and the base model
  id are refused with a 400 that says why;
- ``lora``: served by vLLM's LoRA support (quantized kernels), one `LoRARequest` attached to
  every request that has it; ``nts_adapter: false`` or naming the base model id
  (`ServedAdapter.base_model_id`, listed in ``/v1/models``) serves the model without it.

``nts_adapter`` takes a boolean, or names an adapter by its sha256 (or a prefix of at least 16
hex digits, or its folder name ``adapter-<sha16>``): naming one the server does not hold is a
400. Requests served without the adapter are never shadow-sampled (`RequestAdapter.as_served`):
the online estimator fits T* and the bias on the model as served with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from noisy_temp_server.adapter.serving import ServedAdapter
from noisy_temp_server.engine_contract.engine_env import BOOLEAN_WORDS
from noisy_temp_server.engine_contract.keys import KEY_ADAPTER
from noisy_temp_server.server.errors import OpenAIError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from noisy_temp_server.server.state import ServerState

__all__ = [
    "NO_ADAPTER",
    "RequestAdapter",
    "adapter_status",
    "check_model",
    "known_model_ids",
    "listed_model_ids",
    "request_adapter",
]


@dataclass(frozen=True)
class RequestAdapter:
    """What one request is served with: the adapter's sha256 (None: no adapter) and the
    `LoRARequest` to attach (None: none; the adapter is folded in or not wanted). `as_served`:
    the request sees the model as the server serves it by default (it may be shadow-sampled)."""

    sha256: str | None
    lora_request: LoRARequest | None
    as_served: bool

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's `generate` (empty when no LoRA is attached)."""
        return {} if self.lora_request is None else {"lora_request": self.lora_request}


NO_ADAPTER = RequestAdapter(None, None, as_served=True)
"""What every request of a server without an adapter is served with."""


def _wanted(served: ServedAdapter | None, value: object) -> bool:
    """Whether the request's ``nts_adapter`` value asks for the adapter (None: the default)."""
    if value is None or isinstance(value, bool):
        return value is not False
    if not isinstance(value, str):
        raise OpenAIError(
            f"{KEY_ADAPTER} must be true, false or an adapter's sha256, got {value!r}.",
            param=KEY_ADAPTER,
        )
    if value.strip().lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.strip().lower()]
    if served is None or not served.names(value):
        held = "none" if served is None else f"only {served.sha256}"
        raise OpenAIError(
            f"This server does not hold the adapter `{value}` ({KEY_ADAPTER}); it holds {held}.",
            param=KEY_ADAPTER,
            code="adapter_not_found",
        )
    return True


def request_adapter(
    served: ServedAdapter | None, model: str | None, value: object
) -> RequestAdapter:
    """What a request naming `model` (None: the default) with ``nts_adapter`` = `value` (None:
    not given) is served with; `OpenAIError` (400) for an adapter the server does not hold, for
    asking the adapter while naming the base model, and for turning off a folded adapter (by
    the key or the base model id). `model` must be one of `known_model_ids`."""
    wanted = _wanted(served, value)
    if served is None:
        if wanted and value is not None:
            raise OpenAIError(
                f"This server serves no adapter; drop {KEY_ADAPTER}.", param=KEY_ADAPTER
            )
        return NO_ADAPTER
    base = model == served.base_model_id
    if base and value is not None and wanted:
        raise OpenAIError(
            f"`{model}` is the model without the adapter; name `{served.model_name}` to have "
            "it, or drop nts_adapter.",
            param=KEY_ADAPTER,
        )
    if base or not wanted:
        if served.path == "folded":
            raise OpenAIError(
                f"The adapter {served.sha256[:16]}... is folded into the served weights, so "
                "no request can be served without it (a server started with "
                "--adapter-serving lora can).",
                param=KEY_ADAPTER,
            )
        return RequestAdapter(None, None, as_served=False)
    lora = served.lora_request if served.path == "lora" else None
    return RequestAdapter(served.sha256, lora, as_served=True)


def listed_model_ids(model_name: str, served: ServedAdapter | None) -> list[str]:
    """The model ids `/v1/models` lists: the served one, then the base model's (LoRA path)."""
    if served is None or served.path != "lora":
        return [model_name]
    return [model_name, served.base_model_id]


def known_model_ids(model_name: str, served: ServedAdapter | None) -> list[str]:
    """The model ids a request may name without a 404: the listed ones, and the base model's
    wherever there is an adapter (`request_adapter` says why it cannot be served folded)."""
    return [model_name] if served is None else [model_name, served.base_model_id]


def adapter_status(served: ServedAdapter | None) -> dict[str, Any]:
    """The adapter part of ``/v1/nts/status``: path (``folded``, ``lora`` or ``none``), sha256,
    rank, the base model id and the calibration's KL at T = 1 without and with the adapter on
    its test prompts (`CalibratedKl`; None where there is none)."""
    if served is None:
        return {
            "path": "none",
            "sha256": None,
            "rank": None,
            "base_model_id": None,
            "calibrated_kl": None,
        }
    return {
        "path": served.path,
        "sha256": served.sha256,
        "rank": served.rank,
        "base_model_id": served.base_model_id if served.path == "lora" else None,
        "calibrated_kl": None if served.calibrated_kl is None else vars(served.calibrated_kl),
    }


def check_model(state: ServerState, requested: str | None) -> None:
    """An `OpenAIError` (404, `model_not_found`) unless `requested` (None: the default) is a
    model id this server serves (`known_model_ids`)."""
    served = listed_model_ids(state.model_name, state.adapter)
    if requested is not None and requested not in known_model_ids(state.model_name, state.adapter):
        raise OpenAIError(
            f"The model `{requested}` does not exist; this server serves "
            f"{' and '.join(f'`{name}`' for name in served)} (see GET /v1/models).",
            status_code=404,
            param="model",
            code="model_not_found",
        )
