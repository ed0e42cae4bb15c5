"""The identity of a model of a pair: which weights, or which perturbation of which ones.

A profile records the identity of both models of the pair it was calibrated on, and the server
checks it against the pair it serves (`ModelIdentity.matches`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from noisy_temp_server.checkpoints.checkpoint import MANIFEST_FILENAME, read_manifest
from noisy_temp_server.checkpoints.model_folder import content_sha256, display_name
from noisy_temp_server.checkpoints.perturbation import (
    PerturbationSpec,
    RuntimeLogitNoiseSpec,
    parse_spec,
)

__all__ = ["ModelIdentity"]


class ModelIdentity(BaseModel):
    """A model as a profile (and the server) knows it.

    Attributes:
        name: a display name (the checkpoint folder's name).
        weights_sha256: sha256 of the weights file; None for weights that exist only in memory
            (a perturbation applied at calibration time, never written).
        clean_weights_sha256: for a model made from a clean checkpoint by `perturbation`, that
            checkpoint's weights sha256 (recorded in the manifest `perturb` and `serve` write).
        perturbation: the spec that made this model from that clean checkpoint (a runtime
            logit noise spec leaves the weights as they are but is part of what is served).

    Two identities `match` when they record the same perturbation (or none) and either the same
    weights or the same clean weights: the same spec on the same clean weights gives
    byte-identical weights, whether written by `perturb`, by `serve`, or applied in memory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    weights_sha256: str | None
    clean_weights_sha256: str | None = None
    perturbation: PerturbationSpec | None = None

    @classmethod
    def of_checkpoint(cls, path: Path, cache_dir: Path | None = None) -> ModelIdentity:
        """Identity of a model folder: a checkpoint of ours from its manifest
        (CorruptCheckpointError if it is damaged; PerturbationSpecError if it records an invalid
        perturbation), a plain folder from its weights' content hash (`content_sha256`, cached
        in `cache_dir`; ModelFolderError without weights)."""
        path = Path(path)
        if not (path / MANIFEST_FILENAME).is_file():
            return cls(name=display_name(path), weights_sha256=content_sha256(path, cache_dir))
        manifest = read_manifest(path)
        recorded_clean = manifest.metadata.get("clean")
        recorded_spec = manifest.metadata.get("perturbation")
        return cls(
            name=Path(path).resolve().name,
            weights_sha256=manifest.weights_sha256,
            clean_weights_sha256=(
                recorded_clean.get("weights_sha256") if isinstance(recorded_clean, dict) else None
            ),
            perturbation=parse_spec(recorded_spec) if recorded_spec else None,
        )

    @classmethod
    def perturbed(cls, clean: ModelIdentity, spec: PerturbationSpec) -> ModelIdentity:
        """`clean` perturbed by `spec` in memory: no weights sha256 (the weights were never
        written), except for runtime logit noise, which serves the clean weights."""
        unchanged = isinstance(spec, RuntimeLogitNoiseSpec)
        return cls(
            name=f"{clean.name} + {spec.label}",
            weights_sha256=clean.weights_sha256 if unchanged else None,
            clean_weights_sha256=clean.weights_sha256,
            perturbation=spec,
        )

    def matches(self, other: ModelIdentity) -> bool:
        """Whether `other` is the same model (see the class docstring)."""
        if self.perturbation != other.perturbation:
            return False
        same_weights = self.weights_sha256 is not None and (
            self.weights_sha256 == other.weights_sha256
        )
        same_clean = self.clean_weights_sha256 is not None and (
            self.clean_weights_sha256 == other.clean_weights_sha256
        )
        return same_weights or same_clean

    def describe(self) -> str:
        """One line for error messages: name, weights and how the model was made."""
        weights = (
            "weights only in memory"
            if self.weights_sha256 is None
            else f"weights sha256 {self.weights_sha256[:12]}..."
        )
        if self.perturbation is None:
            return f"{self.name} ({weights})"
        clean = (
            "an unrecorded clean model"
            if self.clean_weights_sha256 is None
            else f"clean weights sha256 {self.clean_weights_sha256[:12]}..."
        )
        return f"{self.name} ({weights}; {self.perturbation.label} of {clean})"
