"""noisy-temp-server inside vLLM: thin adapters from vLLM's logits-processor interfaces to the
vLLM-free per-step core (`noisy_temp_server.step`).

Modules (import them directly; this package imports nothing, so importing it stays cheap):

- `processor`: `NoisyTemperatureLogitsProcessor`, the per-step temperature T* (entry point
  ``vllm.logits_processors: noisy_temperature``), built as `processor_v1.NoisyTemperatureV1` or
  `processor_v2.NoisyTemperatureV2` by the runner (`runners`);
- `processor_common`: what both share: construction (`build_slot_tuning`), the registry of
  built processors, a request's tuning and its validation;
- `capture`: which requests' served logits are captured, from vLLM's sampling parameters;
- `batch_rows`: vLLM's persistent-batch updates applied to per-row columns (V1 runner);
- `runtime_noise`: `RuntimeLogitNoiseProcessor`, fresh logit noise each step (by name only);
- `runners`: one entry-point class for vLLM's V1 runner and Model Runner V2;
- `cpu_amx`: the AMX permission the CPU build needs.
"""

__all__: list[str] = []
