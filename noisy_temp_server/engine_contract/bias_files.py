"""Where the engine finds per-token bias files, and loading one by its content hash.

A policy names its bias by content hash (`TemperaturePolicy.bias`); the vector is the file
``bias_file_name(sha256)`` (`correction.files.save_bias_file`) in one of the engine's
*bias directories*: ``$NTS_BIAS_DIR``, a search path of folders separated by ``os.pathsep``
(``:``) looked up in order (safe, since the name is the content hash), else the folder of
``$NTS_POLICY_FILE`` when that policy names a bias (`calibrate` writes the two side by side).
Without either no bias is possible, and a request whose policy names one is refused
(`step.logit_bias.check_correction`, run by the processors' ``validate_params``: HTTP 400).
``noisy-temp-server serve`` sets ``NTS_BIAS_DIR`` for its engine only when its policy can name
a bias (`server.engine.publish_bias_directories`: the profile's folder, then the folder the
online refinement publishes to). The API process reads the same directories (the online
learner's startup checks and shadow scorer), so both load the vector the engine serves.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from noisy_temp_server.correction.files import find_bias_file
from noisy_temp_server.engine_contract.engine_env import engine_config
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, KEY_BIAS, KEY_POLICY
from noisy_temp_server.engine_contract.request_args import (
    default_policy_json,
    parse_policy_json,
)

__all__ = ["bias_directories", "load_bias"]

_LOADED_BIASES = 8


def bias_directories() -> tuple[Path, ...]:
    """Where the engine finds bias files, in order: the folders of ``NTS_BIAS_DIR``
    (`EngineConfig.bias_dirs`), else the folder of ``NTS_POLICY_FILE`` when that policy names
    a bias, else none (no bias possible). Raises ValueError when the policy file is needed and
    invalid."""
    config = engine_config()
    if config.bias_dirs:
        return config.bias_dirs
    if config.policy_file is not None and parse_policy_json(default_policy_json()).bias is not None:
        return (config.policy_file.parent,)
    return ()


@lru_cache(maxsize=_LOADED_BIASES)
def _load_bias(directories: tuple[Path, ...], sha256: str) -> torch.Tensor:
    return find_bias_file(directories, sha256)


def load_bias(sha256: str) -> torch.Tensor:
    """The bias vector (float32 [V] on the CPU) with content hash ``sha256`` from the first bias
    directory that has it; read once per (directories, hash) while recently used. ValueError
    (a 400 at admission) when there is no bias directory, no such file, or the file does not
    hold it."""
    directories = bias_directories()
    if not directories:
        raise ValueError(
            f"the policy ({KEY_POLICY}) names the per-token bias {sha256[:16]}..., but this "
            f"engine has no bias directory ({BIAS_DIR_ENV}); send {KEY_BIAS}=false or a policy "
            "without a bias."
        )
    try:
        return _load_bias(directories, sha256)
    except ValueError as error:
        raise ValueError(
            f"the per-token bias {sha256[:16]}... of the policy is not available to this "
            f"engine: {error}"
        ) from None
