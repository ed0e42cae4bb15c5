"""Starting a real vLLM engine on CPU inside the test process.

`start_llm` builds a `vllm.LLM` with what CPU tests need: float32 (this host's CPUs may lack
AVX-512 BF16, and float32 is what the transformers references compute in), a short
`max_model_len`, eager mode (no torch.compile warm-up), and the engine core kept in the test
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no spawned process to leak or orphan). It also pins
the V1 model runner (see docs/architecture.md, "Runner"). The engine lowers torch's thread count
of the whole process to 1 and binds it to the CPUs; tests that time things should run before it
or in another process.

Start engines in module- or session-scoped fixtures: each start costs several seconds.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

__all__ = ["VLLM_TEST_ENV", "start_llm", "stop_llm"]

VLLM_TEST_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def start_llm(model_dir: Path, *, max_model_len: int = 512, **engine_args: Any) -> Any:
    """A `vllm.LLM` for the checkpoint folder `model_dir`; `engine_args` override the defaults."""
    for name, value in VLLM_TEST_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM  # noqa: PLC0415 (after the environment is set)

    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": max_model_len,
        "enforce_eager": True,
        "seed": 0,
    }
    settings.update(engine_args)
    return LLM(model=str(model_dir), **settings)


def stop_llm(llm: Any) -> None:
    """Shut the engine down and release its memory."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
