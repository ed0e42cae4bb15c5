"""One entry point for both of vLLM's model runners, and what the two adapters share.

vLLM 0.32 has two logits-processor interfaces and two loaders reading the same entry-point group
``vllm.logits_processors``:

- the V1 runner (``vllm/v1/sample/logits_processor/__init__.py``) loads every entry point and
  calls ``cls(vllm_config, device, is_pin_memory)``; it checks ``issubclass(cls, V1
  LogitsProcessor)`` only for classes passed by name, and calls ``cls.validate_params``;
- Model Runner V2 (``vllm/v1/worker/gpu/sample/logits_processor/loader.py``) refuses any entry
  point that is not ``issubclass(cls, V2 LogitsProcessor)``, calls ``cls.validate_params`` in the
  frontend and ``cls(vllm_config, req_states)`` in the worker.

`dual_runner_class` builds a class that subclasses *both* ABCs (so both loaders accept it) and
whose ``__new__`` looks at the constructor arguments: a `LogitsProcRequestState` second argument
means V2, anything else (a device) V1. It returns a fully built instance of the runner's own
implementation class, which is not a subclass of the dispatcher, so Python does not call
``__init__`` again. ``validate_params`` is shared. No environment variable is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed import parallel_state
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsProcessor as V2LogitsProcessor,
)
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsProcRequestState,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["RunnerDispatch", "is_v2_call", "reports_on_this_rank"]


def is_v2_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether constructor arguments are Model Runner V2's ``(vllm_config, req_states)``."""
    second = args[1] if len(args) > 1 else kwargs.get("req_states")
    return isinstance(second, LogitsProcRequestState)


# The two ABCs declare different `apply` signatures; no instance of this class is ever made
# (`__new__` returns an implementation), so the clash is only nominal.
class RunnerDispatch(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc]
    """Base of an entry-point class serving both runners.

    Subclasses set ``v1_class`` and ``v2_class`` (their implementations) and define
    ``validate_params``; constructing the subclass returns an instance of one of the two.
    """

    v1_class: type[V1LogitsProcessor]
    v2_class: type[V2LogitsProcessor]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        implementation: type[Any] = cls.v2_class if is_v2_call(args, kwargs) else cls.v1_class
        return implementation(*args, **kwargs)


def reports_on_this_rank(vllm_config: VllmConfig) -> bool:
    """Whether this worker reports traces and metrics: the first tensor-parallel rank only
    (every rank runs the processor on identical logits). True outside a distributed setup."""
    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0
