"""The engine's configuration: what the API process hands to vLLM's engine process.

vLLM builds our processors inside its engine process with no argument of ours, so their
configuration travels in the environment that process inherits. `EngineConfig` is that
configuration, and the one reader and writer of the ``NTS_*`` variables (`keys.ENGINE_ENV_NAMES`):

- the server writes it with `EngineConfig.apply` (`server.engine`, before the engine starts);
- the engine side reads it with `engine_config` (the processors, the trace sender, the default
  policy, the bias directories, the capture bounds);
- a stock vLLM server with this package installed reads the same variables, set by hand.

An unset or empty variable means the field's default. A value that does not parse, or is out of
range, is a ValueError naming the variable and the value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from noisy_temp_server.engine_contract.keys import (
    BIAS_DIR_ENV,
    CAPTURE_POSITIONS_ENV,
    CAPTURE_QUEUE_ROWS_ENV,
    CAPTURE_ROWS_PER_STEP_ENV,
    ENGINE_ENV_NAMES,
    FUSED_STEP_ENV,
    POLICY_FILE_ENV,
    RUNTIME_NOISE_SEED_ENV,
    RUNTIME_NOISE_SIGMA_ENV,
    TRACE_ENDPOINT_ENV,
)

__all__ = ["BOOLEAN_WORDS", "EngineConfig", "engine_config"]

_PARSED_CONFIGS = 8


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs from the server, one field per ``NTS_*`` variable.

    ``trace_endpoint`` (``NTS_TRACE_ENDPOINT``): the ZeroMQ address of the API process's trace
    collector (None: the engine reports nothing). ``bias_dirs`` (``NTS_BIAS_DIR``, joined by
    ``os.pathsep``): the folders bias files are looked up in, in order.
    ``policy_file`` (``NTS_POLICY_FILE``): the engine's default policy, for requests without
    ``nts_policy`` (None: the identity policy). ``runtime_noise_sigma``, ``runtime_noise_seed``
    (``NTS_RUNTIME_NOISE_SIGMA``, ``NTS_RUNTIME_NOISE_SEED``): the runtime logit noise processor's
    default σ (logit units, 0: off) and seed. ``capture_rows_per_step``, ``capture_positions``,
    ``capture_queue_rows`` (``NTS_CAPTURE_*``, the settings of the same names): the bounds of the
    capture of served logits. ``fused_step`` (``NTS_FUSED_STEP``, the setting of the same name):
    on CUDA, the T* step of every rule runs as Triton kernels where Triton imports (false: as
    separate torch operations everywhere).

    Refuses (ValueError naming the variable) a σ that is not finite and >= 0, a capture bound
    below 1, and a bias folder whose path holds ``os.pathsep`` (it could not be listed).
    """

    trace_endpoint: str | None = None
    bias_dirs: tuple[Path, ...] = ()
    policy_file: Path | None = None
    runtime_noise_sigma: float = 0.0
    runtime_noise_seed: int = 0
    capture_rows_per_step: int = 8
    capture_positions: int = 128
    capture_queue_rows: int = 64
    fused_step: bool = True

    def __post_init__(self) -> None:
        sigma = self.runtime_noise_sigma
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(
                f"{RUNTIME_NOISE_SIGMA_ENV}={sigma!r}: expected a finite number >= 0 (logit units)."
            )
        for name in ("capture_rows_per_step", "capture_positions", "capture_queue_rows"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{_VARIABLE_OF_FIELD[name]}={getattr(self, name)!r}: expected an integer >= 1."
                )
        for folder in self.bias_dirs:
            if os.pathsep in str(folder):
                raise ValueError(
                    f"{BIAS_DIR_ENV}: the folder {str(folder)!r} holds {os.pathsep!r}, which "
                    "separates the folders of the list; rename or link it."
                )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EngineConfig:
        """The configuration the ``NTS_*`` variables of ``environ`` describe (unset or empty:
        the field's default). Raises ValueError naming the variable when a value does not parse
        or is out of range (see the class)."""
        values: dict[str, Any] = {}
        for name, variable in _VARIABLE_OF_FIELD.items():
            text = environ.get(variable, "").strip()
            if text:
                values[name] = _PARSERS[name](variable, text)
        return cls(**values)

    def to_environ(self) -> dict[str, str]:
        """The ``NTS_*`` variables of the fields that differ from their defaults;
        `from_environ` of the result gives back an equal configuration."""
        defaults = EngineConfig()
        return {
            variable: _as_text(getattr(self, name))
            for name, variable in _VARIABLE_OF_FIELD.items()
            if getattr(self, name) != getattr(defaults, name)
        }

    def apply(self, environ: MutableMapping[str, str]) -> None:
        """Write this configuration into ``environ`` (the process environment the engine will
        inherit): `to_environ`'s variables are set, the other ``NTS_*`` engine variables
        removed."""
        written = self.to_environ()
        for name in ENGINE_ENV_NAMES:
            if name in written:
                environ[name] = written[name]
            else:
                environ.pop(name, None)


def engine_config() -> EngineConfig:
    """The engine's configuration from this process's environment (`EngineConfig.from_environ`
    of ``os.environ``). The variables are looked up on every call, so a change to them is seen;
    each distinct set of values is parsed once. Raises ValueError as `from_environ` does."""
    return _parsed(tuple(os.environ.get(name, "") for name in ENGINE_ENV_NAMES))


@lru_cache(maxsize=_PARSED_CONFIGS)
def _parsed(values: tuple[str, ...]) -> EngineConfig:
    return EngineConfig.from_environ(dict(zip(ENGINE_ENV_NAMES, values, strict=True)))


def _as_text(value: object) -> str:
    if isinstance(value, tuple):
        return os.pathsep.join(str(folder) for folder in value)
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


def _as_int(variable: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected an integer.") from None


def _as_float(variable: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected a number.") from None


BOOLEAN_WORDS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}
"""The words a boolean may be written as (any case), and what each means: the one list for
every channel (the ``NTS_*`` variables here, the settings' flags, the ``nts_*`` request keys of
`request_args` and the server's ``nts_adapter``)."""


def _as_bool(variable: str, text: str) -> bool:
    value = BOOLEAN_WORDS.get(text.lower())
    if value is None:
        raise ValueError(f"{variable}={text!r}: expected true or false.")
    return value


def _as_folders(_variable: str, text: str) -> tuple[Path, ...]:
    return tuple(Path(entry.strip()) for entry in text.split(os.pathsep) if entry.strip())


_VARIABLE_OF_FIELD = {
    "trace_endpoint": TRACE_ENDPOINT_ENV,
    "bias_dirs": BIAS_DIR_ENV,
    "policy_file": POLICY_FILE_ENV,
    "runtime_noise_sigma": RUNTIME_NOISE_SIGMA_ENV,
    "runtime_noise_seed": RUNTIME_NOISE_SEED_ENV,
    "capture_rows_per_step": CAPTURE_ROWS_PER_STEP_ENV,
    "capture_positions": CAPTURE_POSITIONS_ENV,
    "capture_queue_rows": CAPTURE_QUEUE_ROWS_ENV,
    "fused_step": FUSED_STEP_ENV,
}
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "trace_endpoint": lambda _variable, text: text,
    "bias_dirs": _as_folders,
    "policy_file": lambda _variable, text: Path(text),
    "runtime_noise_sigma": _as_float,
    "runtime_noise_seed": _as_int,
    "capture_rows_per_step": _as_int,
    "capture_positions": _as_int,
    "capture_queue_rows": _as_int,
    "fused_step": _as_bool,
}
