"""The capture of served logits (`step.capture`) admitted from vLLM's sampling parameters:
which requests may be captured (`capturable`), under which trace id (`capture_trace_id`), and
the capture keyed by vLLM's V1 batch rows or V2 slots (`LogitCapture`).
"""

from __future__ import annotations

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from noisy_temp_server.engine_contract.request_args import GREEDY_TEMPERATURE
from noisy_temp_server.step.capture import CaptureBounds, RowCapture, trace_id_to_capture
from noisy_temp_server.vllm_plugin.batch_rows import apply_batch_update

__all__ = [
    "LogitCapture",
    "capturable",
    "capture_bounds_from_settings",
    "capture_trace_id",
]


def capture_bounds_from_settings() -> CaptureBounds:
    """The bounds of `Settings` (``NTS_CAPTURE_*`` in the engine's environment, which the server
    sets from its own settings)."""
    from noisy_temp_server.settings import Settings  # noqa: PLC0415 (engine process only)

    settings = Settings()
    return CaptureBounds(
        rows_per_step=settings.capture_rows_per_step,
        positions=settings.capture_positions,
        queue_rows=settings.capture_queue_rows,
    )


def capturable(params: SamplingParams) -> bool:
    """Whether the rows vLLM samples a request from are the served model's own, so that the
    shadow scorer may sample it: not greedy (see `capture_trace_id`), and no penalties, logit
    bias, minimum length, bad words or allowed-token list (vLLM applies them before our
    processor: the rows would measure them, not the model)."""
    return (
        params.temperature >= GREEDY_TEMPERATURE
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and not params.min_tokens
        and not params.bad_words
        and params.allowed_token_ids is None
    )


def capture_trace_id(params: SamplingParams) -> str | None:
    """`step.capture.trace_id_to_capture` of a request's sampling parameters."""
    return trace_id_to_capture(params.extra_args, params.temperature)


class LogitCapture(RowCapture):
    """`step.capture.RowCapture` admitted from vLLM: V1 follows the persistent batch
    (`update`, keyed by batch row), V2 its slots (`add_request`)."""

    def update(self, batch_update: BatchUpdate | None) -> None:
        """V1: follow the persistent batch (the key is the batch row)."""
        apply_batch_update(self.keys, batch_update, self._write)

    def add_request(self, slot: int, params: SamplingParams) -> bool:
        """V2: slot ``slot`` has a new occupant; True when it is captured."""
        return self.admit(slot, capture_trace_id(params), params.temperature, [])

    def _write(self, key: int, params: SamplingParams, outputs: list[int]) -> bool:
        return self.write(key, capture_trace_id(params), params.temperature, outputs)
