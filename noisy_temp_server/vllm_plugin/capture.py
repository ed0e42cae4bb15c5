"""The capture of served logits (`step.capture`) admitted from vLLM's sampling parameters: the
capture keyed by vLLM's V1 batch rows or V2 slots (`LogitCapture`). Under which trace id a
request is captured is its `request_args.AdmittedRequest.capture_trace_id`, from the T*
processor's one parse of its keys (which requests the server may mark for it:
`engine_contract.request_args.capturable`).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from noisy_temp_server.step.capture import RowCapture
from noisy_temp_server.vllm_plugin.batch_rows import apply_batch_update

__all__ = ["LogitCapture"]


class LogitCapture(RowCapture):
    """`step.capture.RowCapture` admitted from vLLM: V1 follows the persistent batch
    (`update`, keyed by batch row), V2 its slots (`add_request`)."""

    def update(self, batch_update: BatchUpdate | None, trace_ids: Sequence[str | None]) -> None:
        """V1: follow the persistent batch (the key is the batch row). ``trace_ids``: the
        capture trace id of each request of ``batch_update.added``, in that order (None: not
        captured); `apply_batch_update` admits them in that order."""
        added = iter(trace_ids)

        def write(key: int, params: SamplingParams, outputs: list[int]) -> bool:
            return self.write(key, next(added), params.temperature, outputs)

        apply_batch_update(self.keys, batch_update, write)

    def add_request(self, slot: int, params: SamplingParams, trace_id: str | None) -> bool:
        """V2: slot ``slot`` has a new occupant, captured under ``trace_id`` (None: not
        captured); True when it is captured."""
        return self.admit(slot, trace_id, params.temperature, [])
