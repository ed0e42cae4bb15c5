"""The pair `serve` serves: which folder is served, what it is scored against, and how the two
differ; and the scorer of its clean side for the shadow scorer.

`resolve_served_pair` turns the serving choices (a served folder, a clean folder, a
perturbation spec) into a `ServedPair`, writing the served checkpoint into the cache when a
weight perturbation needs one. `clean_pair_scorer` builds the `PairScorer` of the clean side
only: the served rows come from the engine's capture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from noisy_temp_server.checkpoints.checkpoint import MANIFEST_FILENAME, load_causal_lm
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.model_folder import (
    check_model_folder,
    check_pair_folders,
    resolve_model_folder,
)
from noisy_temp_server.checkpoints.perturbation import (
    ExternalPairSpec,
    PerturbationSpec,
    RuntimeLogitNoiseSpec,
    parse_spec,
)
from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint
from noisy_temp_server.phases import logged_phase
from noisy_temp_server.scoring.clean_backend import RemoteClean
from noisy_temp_server.scoring.scorer import PairScorer

__all__ = ["ServedPair", "clean_pair_scorer", "resolve_served_pair"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedPair:
    """What `serve` serves (`served`), what it scores against (`clean`, None: no shadow
    scoring) and how the two differ (`spec`, None when unknown)."""

    served: Path
    clean: Path | None
    spec: PerturbationSpec | None

    @property
    def runtime_noise(self) -> RuntimeLogitNoiseSpec | None:
        """The runtime logit noise the engine and the shadow scorer add, if any."""
        return self.spec if isinstance(self.spec, RuntimeLogitNoiseSpec) else None

    def served_vocab_size(self) -> int:
        """The vocabulary size in the served folder's config (read from the disk)."""
        return int(AutoConfig.from_pretrained(self.served, local_files_only=True).vocab_size)


def _served_checkpoint_pair(served: Path, clean: Path | None) -> ServedPair:
    """The pair of a served folder: the perturbation recorded in its manifest, if it has one.

    A runtime-noise checkpoint (`perturb` copies the clean weights and records the spec) is
    served with that noise, and is its own clean reference unless `clean` says otherwise.
    """
    if not (served / MANIFEST_FILENAME).is_file():
        return ServedPair(served, clean, None)
    identity = ModelIdentity.of_checkpoint(served)
    spec = identity.perturbation
    if isinstance(spec, RuntimeLogitNoiseSpec):
        if clean is None and identity.clean_weights_sha256 == identity.weights_sha256:
            clean = served
        _LOGGER.info(
            "%s records %s in its manifest: serving it with that runtime noise, scored against %s",
            served,
            spec.label,
            clean or "nothing (no clean model known; pass --clean-model)",
        )
    return ServedPair(served, clean, spec)


def _checked(pair: ServedPair) -> ServedPair:
    """`pair`, once its folders are checked as a pair (`check_pair_folders`: ModelFolderError
    naming the first problem), before any engine starts."""
    if pair.clean is None or pair.clean.resolve() == pair.served.resolve():
        check_model_folder(pair.served)
    else:
        check_pair_folders(pair.clean, pair.served)
    return pair


def resolve_served_pair(
    *, served_model: Path | None, clean_model: Path | None, perturbation: str, cache_dir: Path
) -> ServedPair:
    """The served/clean pair these choices name, writing the served checkpoint if needed.

    Folders may be given as Hugging Face model ids (`resolve_model_folder`); a served folder and
    a clean one given together are checked as a pair (`_checked`). `served_model` wins (a
    perturbation its manifest records, see `_served_checkpoint_pair`); else the
    spec `perturbation` (JSON, `parse_spec`: PerturbationSpecError when invalid) applies to
    `clean_model` or the default model (converted once into `cache_dir`): an external pair names
    both folders, runtime logit noise serves the clean weights as they are, and weight
    perturbations are written once to the cache (`ensure_perturbed_checkpoint`).
    """
    clean_model = None if clean_model is None else resolve_model_folder(clean_model)
    if served_model is not None:
        return _checked(_served_checkpoint_pair(resolve_model_folder(served_model), clean_model))
    spec = parse_spec(perturbation)
    if isinstance(spec, ExternalPairSpec):
        served = resolve_model_folder(spec.served_path)
        clean = clean_model or resolve_model_folder(spec.clean_path)
        return _checked(ServedPair(served, clean, spec))
    with logged_phase(
        _LOGGER, "Preparing the default model (converting the embedded GGUF if needed)"
    ):
        clean = clean_model or ensure_default_model(cache_dir)
    if isinstance(spec, RuntimeLogitNoiseSpec):
        _LOGGER.info("Serving the clean weights of %s with %s", clean, spec.label)
        return ServedPair(clean, clean, spec)
    with logged_phase(
        _LOGGER, f"Preparing the served model ({spec.label}; written once to the cache)"
    ):
        served = ensure_perturbed_checkpoint(clean, spec, cache_dir)
    return ServedPair(served, clean, spec)


def clean_pair_scorer(
    pair: ServedPair,
    *,
    remote_url: str | None,
    remote_model: str,
    api_key: str | None,
    timeout_s: float,
    device: str,
    dtype: str,
) -> PairScorer:
    """The `PairScorer` of `pair`'s clean side only (the served rows come from the engine,
    `vllm_plugin.capture`), scoring on `device`: with `remote_url`, the remote clean server
    there serving `remote_model` (over the served model's vocabulary,
    `ServedPair.served_vocab_size`; `api_key` and `timeout_s` for its requests); else the
    pair's clean model loaded in this process in `dtype` (a torch dtype's name; ValueError when
    the pair has no clean model)."""
    if remote_url is not None:
        vocab_size = pair.served_vocab_size()
        remote = RemoteClean(
            remote_url, remote_model, vocab_size=vocab_size, api_key=api_key, timeout_s=timeout_s
        )
        return PairScorer(remote, device=device)
    if pair.clean is None:
        raise ValueError("shadow scoring needs a clean model; pass --clean-model")
    with logged_phase(_LOGGER, f"Loading the clean model for shadow scoring on {device}"):
        clean, _ = load_causal_lm(pair.clean, device=device, dtype=getattr(torch, dtype))
    return PairScorer(clean, device=device)
