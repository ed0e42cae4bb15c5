"""Materialise a perturbation: the clean checkpoint, perturbed, written as a checkpoint folder.

The one place that turns (clean checkpoint, spec) into a served checkpoint, used by
`noisy-temp-server perturb` and by `serve` for its default pair. The manifest's metadata
records the spec and the clean model's identity, which is what a profile is matched against.
"""

from __future__ import annotations

from pathlib import Path

from noisy_temp_server.pairs.checkpoint import (
    CheckpointManifest,
    load_causal_lm,
    read_manifest,
    save_checkpoint,
)
from noisy_temp_server.pairs.perturbation import (
    ExternalPairSpec,
    PerturbationSpec,
    PerturbationSpecError,
    RuntimeLogitNoiseSpec,
    apply_perturbation,
    spec_to_json,
)

__all__ = ["write_perturbed_checkpoint"]


def write_perturbed_checkpoint(
    clean_dir: Path, spec: PerturbationSpec, dest: Path, *, source: str, replace: bool = False
) -> CheckpointManifest:
    """Write `clean_dir` perturbed by `spec` to `dest` (atomically) and return its manifest.

    A runtime-logit-noise spec leaves the weights as they are and is only recorded (the server's
    runtime noise processor applies it). The same spec on the same clean checkpoint gives
    byte-identical weights. Raises `PerturbationSpecError` for an external-pair spec (already
    perturbed elsewhere), `FileExistsError` if `dest` exists and not `replace`, and
    `CorruptCheckpointError` for a damaged clean checkpoint.
    """
    if isinstance(spec, ExternalPairSpec):
        raise PerturbationSpecError(
            "an external pair is already perturbed; pass its two paths to `calibrate` instead"
        )
    clean_manifest = read_manifest(clean_dir)
    model, tokenizer = load_causal_lm(clean_dir)
    details: dict[str, object] = {}
    if not isinstance(spec, RuntimeLogitNoiseSpec):
        summary = apply_perturbation(model, spec)
        details = {
            "tensors": len(summary.tensors),
            "elements": summary.elements,
            "untied_output_head": summary.untied_output_head,
        }
    clean_name = clean_dir.resolve().name
    return save_checkpoint(
        dest,
        model,
        tokenizer,
        kind="perturbed",
        description=f"{clean_name} with {spec.label}",
        source=source,
        metadata={
            "perturbation": spec_to_json(spec),
            "clean": {"name": clean_name, "weights_sha256": clean_manifest.weights_sha256},
            **details,
        },
        replace=replace,
    )
