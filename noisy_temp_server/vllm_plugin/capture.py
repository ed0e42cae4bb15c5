"""The capture of served logits (`step.capture`) admitted from vLLM's sampling parameters:
under which trace id a request is captured (`capture_trace_id`; which requests the server may
mark for it: `engine_contract.request_args.capturable`), and the capture keyed by vLLM's V1
batch rows or V2 slots (`LogitCapture`).
"""

from __future__ import annotations

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from noisy_temp_server.step.capture import RowCapture, trace_id_to_capture
from noisy_temp_server.vllm_plugin.batch_rows import apply_batch_update

__all__ = [
    "LogitCapture",
    "capture_trace_id",
]


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
