"""vLLM's own engine flags on `serve`: what `vllm serve` takes for its engine (prefix caching,
the KV cache's dtype, chunked prefill, the seed, speculative decoding...), read by vLLM's own
parser (`AsyncEngineArgs.add_cli_args`) and applied over the engine arguments `serve` builds
(`server.engine.build_engine_args`).

They reach it as the setting ``vllm_args`` (on the command line, every flag `serve` does not
have). Refused, in one line naming the flag: a flag vLLM's engine does not have (vLLM's server
flags that are not settings of `serve` are not taken: docs/serving.md), a bad value, a flag
that is a setting of `serve` (pass it as that setting), one `serve` sets itself, and
``--reasoning-parser`` (reasoning is not split out of responses here).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

__all__ = ["engine_flag_overrides"]

_SETTINGS = (
    "served_model_name", "dtype", "max_model_len", "max_num_seqs", "tensor_parallel_size",
    "enforce_eager", "gpu_memory_utilization",
)  # fmt: skip
"""Engine arguments that are settings of `serve` (the same flags)."""
_SET_BY_SERVE = (
    "model", "tokenizer", "kv_cache_memory_bytes", "logprobs_mode", "max_logprobs",
    "logits_processors", "enable_lora", "max_lora_rank", "max_loras", "reasoning_parser",
)  # fmt: skip
"""Engine arguments `serve` sets itself: the served model and its tokenizer, the KV cache
(``--kv-cache-gib``), what the processors and the adapter need."""


def engine_flag_overrides(flags: str) -> dict[str, Any]:
    """The engine arguments ``flags`` (a shell-quoted string of vLLM engine flags) set, by
    field name, each a value vLLM's parser made. Raises ValueError, one line, for a flag vLLM's
    engine does not have, a bad value, or one of `_SETTINGS` or `_SET_BY_SERVE`."""
    parser = _engine_parser()
    try:
        given = shlex.split(flags)
        parsed, unknown = parser.parse_known_args(given)
    except (argparse.ArgumentError, ValueError) as error:
        raise ValueError(f"vLLM engine flags: {error}") from error
    if unknown:
        raise ValueError(f"not a flag of vLLM's engine nor of serve: {' '.join(unknown)}")
    defaults = vars(parser.parse_args([]))
    overrides = {name: value for name, value in vars(parsed).items() if value != defaults[name]}
    for name in overrides:
        flag = "--" + name.replace("_", "-")
        if name in _SETTINGS:
            raise ValueError(f"{flag} is a setting of serve: give it as {flag}, not among vLLM's")
        if name in _SET_BY_SERVE:
            raise ValueError(f"{flag} is set by serve itself and cannot be given")
    return overrides


def _engine_parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 (after the environment)
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    parser = FlexibleArgumentParser(add_help=False, exit_on_error=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser
