"""The compensation adapter: a low-rank correction of every perturbed linear layer, fitted from
the clean/served pair and served by vLLM (folded into float weights, or as a LoRA).

- `lora`: its file format (PEFT LoRA), `LoraAdapter`, `LowRankDelta`, its sha256 (torch only);
- `deltas`: each layer's low-rank fit from its error and inputs (torch only);
- `layer_fit`: the walk through the served model that fits every layer (`fit_compensation_adapter`);
- `distillation`: end-to-end distillation of a fitted adapter on the clean distributions;
- `folded_checkpoint`: the served checkpoint with the adapter folded into its weights;
- `serving`: how an adapter is served on a checkpoint (`plan_serving`) and `ServedAdapter`,
  what the HTTP server reports of it.

Calibration decides whether an adapter helps (`calibration.adapter_calibration`); the server
reports it (`server.adapter`).
"""

from typing import Literal

__all__ = ["AdapterServing"]

AdapterServing = Literal["auto", "folded", "lora", "none"]
"""How an adapter is to be served (the setting `adapter_serving`; `serving.plan_serving`):
``folded`` into float weights, through vLLM's ``lora``, ``auto`` (folded where the served
weights are float, else lora) or ``none``. Here so that settings read it without torch."""
