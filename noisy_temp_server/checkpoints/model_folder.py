"""A model folder as users give it: a path, or a Hugging Face model id found in the local cache;
what it must hold; its identity; and the checks a clean/served pair must pass.

A *plain* folder is any folder transformers and vLLM load: ``config.json``, a tokenizer and
safetensors weights (one file, or shards with an index), float or quantized. The product never
writes into it: its identity (`content_sha256`) is computed from its weight files and cached in
the product's own cache folder, keyed by the folder's path and the weight files' names, sizes
and modification times, so a folder may be read-only (a Hub cache, a mounted volume).

Every problem is a `ModelFolderError` (a ValueError) whose message is one line naming the folder
and the problem; none suggests deleting a folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from noisy_temp_server.files import default_cache_dir, sha256_file, write_atomically

__all__ = [
    "ModelFolderError",
    "check_model_folder",
    "check_pair_folders",
    "content_sha256",
    "display_name",
    "read_config",
    "resolve_model_folder",
    "weight_files",
]

_LOGGER = logging.getLogger(__name__)
_INDEX = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PREFIX = "models--"
_ARCHITECTURE_KEYS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
_SUPPORTED_QUANTIZATION = ("compressed-tensors", "gptq", "awq", "fp8")
_STAT_KEYS = ("st_size", "st_ino", "st_mtime_ns", "st_ctime_ns")


class ModelFolderError(ValueError):
    """A model folder that cannot be used, or a pair that does not go together: one line."""


def _hub_snapshot(model_id: str) -> Path | None:
    """The local snapshot of the Hugging Face model `model_id` (its default revision), found as
    vLLM finds it (`huggingface_hub`, local files only, `HF_HUB_CACHE`/`HF_HOME` honoured);
    None when the cache holds none."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def resolve_model_folder(name: str | Path) -> Path:
    """The model folder `name` names: an existing folder, else a Hugging Face model id
    (``org/name``) found in the local Hugging Face cache (offline). ModelFolderError when it is
    neither, or names a file."""
    path = Path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelFolderError(f"{path} is a file, not a model folder")
    text = str(name)
    if _HUB_ID.match(text):
        snapshot = _hub_snapshot(text)
        if snapshot is not None:
            return snapshot
        raise ModelFolderError(
            f"no model folder {text}, and the local Hugging Face cache holds no model {text} "
            "(download it first, or give its folder)"
        )
    raise ModelFolderError(f"no model folder {text}")


def display_name(path: Path) -> str:
    """A folder's name for people: ``org/name`` for a Hugging Face cache snapshot, else the
    folder's own name."""
    resolved = path.resolve()
    repo = resolved.parent.parent.name
    if resolved.parent.name == "snapshots" and repo.startswith(_HUB_PREFIX):
        return repo.removeprefix(_HUB_PREFIX).replace("--", "/", 1)
    return resolved.name


def read_config(path: Path) -> dict[str, Any]:
    """The folder's ``config.json``; ModelFolderError when missing or unreadable."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise ModelFolderError(f"{path} holds no config.json: not a model folder") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFolderError(f"{path}/config.json is unreadable: {error}") from error
    if not isinstance(config, dict):
        raise ModelFolderError(f"{path}/config.json is not a JSON object")
    return config


def weight_files(path: Path) -> list[Path]:
    """The folder's safetensors weight files, sorted: those its shard index names, else every
    ``*.safetensors``. ModelFolderError when there are none (pickled ``.bin`` weights are
    refused: convert them to safetensors), or the index names a missing file or is corrupt."""
    index = path / _INDEX
    if index.is_file():
        try:
            names = sorted(
                set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            )
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelFolderError(f"{index} is unreadable: {error!r}") from error
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ModelFolderError(f"{path} lacks the shards {missing} its index names")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ModelFolderError(
            f"{path} holds pickled weights (.bin/.pt) only: convert them to safetensors"
        )
    raise ModelFolderError(f"{path} holds no safetensors weights")


def _check_quantization(path: Path, config: dict[str, Any]) -> None:
    """ModelFolderError for a quantization method the product cannot read."""
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method is not None and str(method).lower() not in _SUPPORTED_QUANTIZATION:
        raise ModelFolderError(
            f"{path} is quantized with {method!r}, which this product does not read "
            f"(it reads {', '.join(_SUPPORTED_QUANTIZATION)})"
        )


def check_model_folder(path: Path) -> None:
    """ModelFolderError unless `path` is a folder with a readable config, a supported
    quantization (or none), a tokenizer and safetensors weights."""
    if not path.is_dir():
        raise ModelFolderError(f"no model folder {path}")
    _check_quantization(path, read_config(path))
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelFolderError(f"{path} holds no tokenizer (tokenizer.json)")
    weight_files(path)


def _cache_key(path: Path, files: list[Path]) -> str:
    """The folder's path and each weight file's name, size, inode, modification and change
    times: a file rewritten in place with its size and modification time kept (``cp -p``,
    ``rsync -a``) still changes its change time, which no user can set."""
    stats = [(file.name, *(getattr(file.stat(), key) for key in _STAT_KEYS)) for file in files]
    return hashlib.sha256(json.dumps([str(path.resolve()), stats]).encode()).hexdigest()


def _hash_files(files: list[Path]) -> str:
    """sha256 of the one weights file, or of the ``name sha256`` lines of several."""
    if len(files) == 1:
        return sha256_file(files[0])
    lines = "".join(f"{file.name} {sha256_file(file)}\n" for file in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def content_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """The identity of a plain folder's weights: the sha256 of its one weights file (what a
    checkpoint's manifest records for it), or of the ``name sha256`` lines of its shards.
    Computed once and cached under ``cache_dir/identities/`` (default: the product's cache),
    keyed by the folder's path and the files' names and metadata (`_cache_key`); nothing is
    written into the folder. An unwritable cache only costs the hashing again."""
    files = weight_files(path)
    record = (cache_dir or default_cache_dir()) / "identities" / f"{_cache_key(path, files)}.json"
    try:
        return str(json.loads(record.read_text(encoding="utf-8"))["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    _LOGGER.info("Hashing the weights of %s once (cached in %s)", path, record.parent)
    sha256 = _hash_files(files)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(record, json.dumps({"path": str(path), "sha256": sha256}).encode())
    except OSError as error:
        _LOGGER.warning("Could not cache the identity of %s: %s", path, error)
    return sha256


def _vocabulary(path: Path) -> tuple[int, dict[str, int] | None]:
    """The config's vocabulary size and the tokenizer's token → id map (None: no
    tokenizer.json to read it from)."""
    size = read_config(path).get("vocab_size")
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        return int(size or 0), None
    try:
        document = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFolderError(f"{tokenizer_file} is unreadable: {error}") from error
    vocab = dict(document.get("model", {}).get("vocab") or {})
    vocab.update({token["content"]: token["id"] for token in document.get("added_tokens", [])})
    return int(size or 0), vocab


def check_pair_folders(clean: Path, served: Path, *, same_architecture: bool = False) -> None:
    """ModelFolderError, one line naming the first difference, unless `clean` and `served` are
    usable model folders with the same vocabulary size and tokenizer vocabulary and, with
    `same_architecture` (an adapter is to be fitted), the same architecture and layer sizes."""
    for path in (clean, served):
        check_model_folder(path)
    (clean_size, clean_vocab), (served_size, served_vocab) = _vocabulary(clean), _vocabulary(served)
    if clean_size != served_size:
        raise ModelFolderError(
            f"the clean model's vocabulary has {clean_size} tokens, the served model's "
            f"{served_size}: a pair must share its tokenizer ({clean} / {served})"
        )
    if clean_vocab is not None and served_vocab is not None and clean_vocab != served_vocab:
        differing = sorted(set(clean_vocab.items()) ^ set(served_vocab.items()))[:3]
        raise ModelFolderError(
            f"the clean and served tokenizers differ (e.g. {differing}): a pair must share "
            f"its tokenizer ({clean} / {served})"
        )
    if not same_architecture:
        return
    clean_config, served_config = read_config(clean), read_config(served)
    for key in _ARCHITECTURE_KEYS:
        if clean_config.get(key) != served_config.get(key):
            raise ModelFolderError(
                f"the clean model's {key} is {clean_config.get(key)!r}, the served model's "
                f"{served_config.get(key)!r}: a compensation adapter needs the same architecture"
            )
