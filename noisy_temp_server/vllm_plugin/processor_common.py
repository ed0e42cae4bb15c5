"""What the two runners' T* processors share around `slot_tuning.SlotTuning`: their
construction, the registry of built processors, and the reading of a request's keys.

`build_slot_tuning` builds a processor's tables, reporter and capture and registers it per vLLM
config (`tuning_processor` finds it: the runtime-noise processor hands its noise over to it; a
second processor for the same config is a *duplicate* and does nothing). `admitted_request` is
what a processor does with an admitted request (one parse of its keys, shared by the T* tuning
and the capture), `validate_request` the check behind the entry point's ``validate_params``
(which vLLM runs in its API process, before the request reaches the engine).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams

from noisy_temp_server.engine_contract.engine_env import engine_config
from noisy_temp_server.engine_contract.request_args import (
    AdmittedRequest,
    admit_request,
    default_policy_json,
    parse_request_args,
    resolve_correction,
)
from noisy_temp_server.engine_contract.trace_sender import TraceSender
from noisy_temp_server.step.capture import CaptureBounds
from noisy_temp_server.step.engine_metrics import step_temperature_metrics
from noisy_temp_server.step.logit_bias import check_correction
from noisy_temp_server.step.reports import Reporter
from noisy_temp_server.step.slot_tuning import SlotTuning
from noisy_temp_server.vllm_plugin.capture import LogitCapture
from noisy_temp_server.vllm_plugin.cpu_amx import request_amx_permission
from noisy_temp_server.vllm_plugin.runners import reports_on_this_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "TunedProcessor",
    "admitted_request",
    "build_slot_tuning",
    "tuning_processor",
    "validate_request",
]

_LOGGER = logging.getLogger(__name__)
_INSTANCES: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def tuning_processor(vllm_config: VllmConfig) -> object | None:
    """The (first) T* processor built for ``vllm_config`` in this process, if any."""
    return _INSTANCES.get(id(vllm_config))


def admitted_request(params: SamplingParams) -> AdmittedRequest:
    """What the processor does with a request vLLM admits into its batch: its temperature
    tuning, its per-token bias and its capture (`request_args.admit_request` at the temperature
    vLLM samples it at). The one place the processors read the request keys: once per
    request."""
    return admit_request(params.extra_args, params.temperature)


def validate_request(params: SamplingParams) -> None:
    """Raise ValueError (HTTP 400 in vLLM's server) when the ``nts_*`` keys are invalid or
    name a per-token bias this engine cannot load."""
    check_correction(resolve_correction(parse_request_args(params.extra_args)))


class TunedProcessor:
    """What the two runners' processors share around their `SlotTuning` (``tuning``). vLLM
    validates requests with the entry-point class's ``validate_params``
    (`processor.NoisyTemperatureLogitsProcessor`, `validate_request`), never with these."""

    tuning: SlotTuning
    capture: LogitCapture

    @property
    def bad_rows(self) -> int:
        """Bad rows (NaN or +inf logits, or all masked) of tuned requests, as reported so far;
        rules that read the served row sampled them at T* = 1, step-only rules at their T*."""
        reporter = self.tuning.reporter
        return 0 if reporter is None else reporter.bad_rows


def build_slot_tuning(
    owner: object,
    vllm_config: VllmConfig,
    capacity: int,
    device: torch.device,
    *,
    logits_scaled: bool,
    registry: CollectorRegistry | None,
    keep_last: bool = False,
    vocab_size: int | None = None,
) -> tuple[bool, SlotTuning, LogitCapture]:
    """(duplicate, tuning, capture) for a processor ``owner`` of ``vllm_config``: checks the
    default policy (ValueError at startup when ``NTS_POLICY_FILE`` is invalid), marks a second
    instance for the same config as a duplicate, and reports (and captures, `capture`) only on
    the first tensor-parallel rank. ``vocab_size``: the logits' width, for the per-token bias."""
    if device.type == "cpu":
        request_amx_permission()
    default_policy_json()
    duplicate = _INSTANCES.setdefault(id(vllm_config), owner) is not owner
    if duplicate:
        _LOGGER.warning(
            "%s is loaded twice into one engine (it is an installed entry point; do not also "
            "pass it in logits_processors). The second instance does nothing.",
            type(owner).__name__,
        )
    device = torch.device(device)
    reporter = None
    config = engine_config()
    bounds = CaptureBounds.from_engine_config(config)
    if not duplicate and reports_on_this_rank(vllm_config):
        reporter = Reporter(
            TraceSender.from_env(),
            step_temperature_metrics(registry),
            slots=capacity + 1,
            capture_queue_rows=bounds.queue_rows,
        )
    tuning = SlotTuning(
        capacity,
        device,
        logits_scaled=logits_scaled,
        reporter=reporter,
        pin_memory=device.type == "cuda",
        keep_last=keep_last,
        vocab_size=vocab_size,
        fused_step=None if config.fused_step else False,
    )
    capture = LogitCapture(
        capacity, reporter, bounds, logits_scaled=logits_scaled, pin_memory=device.type == "cuda"
    )
    return duplicate, tuning, capture
