"""noisy-temp-server inside vLLM: the logits processors and what they share with the server.

Modules (import them directly; this package imports nothing, so importing it stays cheap):

- `processor`: `NoisyTemperatureLogitsProcessor`, the per-step temperature T* (entry point
  ``vllm.logits_processors: noisy_temperature``), built as `processor_v1.NoisyTemperatureV1` or
  `processor_v2.NoisyTemperatureV2` by the runner (`runners`);
- `slot_tuning`: the device-side per-slot state and per-step T* both share;
- `processor_common`: the rest both share: construction (`build_slot_tuning`), the registry of
  built processors, a request's tuning and its validation;
- `reports`: the background thread bringing summaries, traces and histogram counts to the host;
- `runtime_noise`: `RuntimeLogitNoiseProcessor`, fresh logit noise each step (by name only);
- `request_args`: the flat ``nts_*`` request keys (one parser for the server and the engine);
- `trace_channel`: the per-step T trace from the engine to the API process (ZeroMQ);
- `metrics`: the engine-side ``nts_step_temperature`` histogram;
- `batch_rows`: per-row state of the V1 runner's persistent batch (runtime noise);
- `runners`: one entry-point class for vLLM's V1 runner and Model Runner V2.
"""

__all__: list[str] = []
