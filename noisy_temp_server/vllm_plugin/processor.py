"""`NoisyTemperatureLogitsProcessor`: the per-step temperature T* inside vLLM's sampler.

Registered under the ``vllm.logits_processors`` entry point (``noisy_temperature``), so every
vLLM engine in this environment loads it, under either model runner (`runners`: one class that
both loaders accept; it builds `processor_v1.NoisyTemperatureV1` or
`processor_v2.NoisyTemperatureV2`). It does nothing for a request unless that request (or the
engine's default policy, ``NTS_POLICY_FILE``) selects a rule other than ``off``. Do not also pass
it in ``logits_processors``: the second instance for the same engine config logs a warning and
does nothing (``duplicate``), so T* is applied once.

Semantics, identical under both runners: the effective temperature is ``T_request × T*``;
greedy rows (T_request < 1e-5) are never tuned; T* is bounded per request; invalid ``nts_*`` keys
fail the request in ``validate_params`` (HTTP 400 in vLLM's server). Where it runs:

- V1 runner (``vllm/v1/sample/sampler.py``): argmax-invariant processors run after penalties,
  the request temperature and min-p, before top-k/top-p: the logits arrive divided by T_request;
- Model Runner V2 (``vllm/v1/worker/gpu/sample/sampler.py``): custom processors run after bias,
  penalties and bad words and *before* temperature, min-p and top-k/top-p: the logits arrive
  unscaled (so min-p is evaluated at T_request × T* there, at T_request under V1).

Per step everything happens on the device (`slot_tuning.SlotTuning`): no device→host copy, no
per-row Python work; a step-only rule costs a table lookup (the request's policy is evaluated
once, at admission). Summaries, traces and the ``nts_step_temperature`` histogram reach the host
through `reports.Reporter`'s background thread. Rules that read the served row (``fisher``, an
entropy-dependent ``calibrated`` table) give a bad row (NaN/+inf logits, all masked) T* = 1;
step-only rules divide it by their finite T* like any other row. Bad rows of every rule are
counted (``bad_rows``).
"""

from __future__ import annotations

from vllm import SamplingParams

from noisy_temp_server.vllm_plugin.processor_common import validate_request
from noisy_temp_server.vllm_plugin.processor_v1 import NoisyTemperatureV1
from noisy_temp_server.vllm_plugin.processor_v2 import NoisyTemperatureV2
from noisy_temp_server.vllm_plugin.runners import RunnerDispatch

__all__ = ["NoisyTemperatureLogitsProcessor"]


class NoisyTemperatureLogitsProcessor(RunnerDispatch):
    """The entry point: ``NoisyTemperatureLogitsProcessor(vllm_config, device, is_pin_memory)``
    (V1 runner) builds a `NoisyTemperatureV1`, ``(vllm_config, req_states)`` (Model Runner V2) a
    `NoisyTemperatureV2`. Both accept the keyword ``registry`` (default: prometheus_client's
    ``REGISTRY``) for ``nts_step_temperature``."""

    v1_class = NoisyTemperatureV1
    v2_class = NoisyTemperatureV2

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError (HTTP 400 in vLLM's server) when the ``nts_*`` keys are invalid or
        name a per-token bias this engine cannot load (`processor_common.validate_request`)."""
        validate_request(sampling_params)
