"""The model-runner pin shared by the processors of this package.

Both processors implement vLLM's V1 logits-processor interface
(``vllm.v1.sample.logits_processor.LogitsProcessor``), which only the V1 model runner calls.
vLLM 0.32 defaults to Model Runner V2 on CUDA, whose processors have another interface; the
server and the Dockerfile therefore pin ``VLLM_USE_V2_MODEL_RUNNER=0`` (docs/architecture.md,
"Runner").

How the two guards interplay:

- Under V2, vLLM's V2 loader (``vllm/v1/worker/gpu/sample/logits_processor/loader.py``) loads
  every class registered under the ``vllm.logits_processors`` entry point and *refuses* V1 classes
  with "V1-interface plugins are not supported by the V2 model runner". Since this package
  registers `NoisyTemperatureLogitsProcessor` there, a V2 engine in the same environment fails
  at startup with that message, before any processor is constructed.
- A class passed by name (``logits_processors=[...]``) to an engine whose config says V2 (or one
  built by hand) reaches the processor's constructor, which calls `require_v1_model_runner` and
  raises `ModelRunnerV2Error` saying what to set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ModelRunnerV2Error", "require_v1_model_runner"]


class ModelRunnerV2Error(RuntimeError):
    """The engine runs vLLM's Model Runner V2, which these V1-interface processors cannot serve."""


def require_v1_model_runner(vllm_config: VllmConfig, processor_name: str) -> None:
    """Raise `ModelRunnerV2Error` when ``vllm_config.use_v2_model_runner`` is true.

    A config without that attribute (vLLM before 0.32, or a test double) counts as V1.
    """
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise ModelRunnerV2Error(
            f"{processor_name} implements vLLM's V1 logits-processor interface, but this engine "
            "uses Model Runner V2. Start vLLM with the environment variable "
            "VLLM_USE_V2_MODEL_RUNNER=0 (the noisy-temp-server CLI and Dockerfile set it)."
        )
