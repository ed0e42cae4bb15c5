"""noisy-temp-server inside vLLM: the logits processors and what they share with the server.

Modules (import them directly; this package imports nothing, so importing it stays cheap):

- `processor`: `NoisyTemperatureLogitsProcessor`, the per-step temperature T* (entry point
  ``vllm.logits_processors: noisy_temperature``);
- `runtime_noise`: `RuntimeLogitNoiseProcessor`, fresh logit noise each step (by name only);
- `request_args`: the flat ``nts_*`` request keys (one parser for the server and the engine);
- `trace_channel`: the per-step T trace from the engine to the API process (ZeroMQ);
- `metrics`: the engine-side ``nts_step_temperature`` histogram;
- `batch_rows`: per-row state of vLLM's persistent batch;
- `runner`: the V1 model-runner requirement (``VLLM_USE_V2_MODEL_RUNNER=0``).
"""

__all__: list[str] = []
