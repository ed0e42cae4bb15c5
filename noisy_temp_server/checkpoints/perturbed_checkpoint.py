"""Materialise a perturbation: the clean checkpoint, perturbed, written as a checkpoint folder.

The one place that turns (clean checkpoint, spec) into a served checkpoint, used by
`noisy-temp-server perturb` and, written once into the cache (`ensure_perturbed_checkpoint`), by
`serve`. The manifest's metadata
records the spec and the clean model's identity, which is what a profile is matched against.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from noisy_temp_server.checkpoints.checkpoint import (
    CheckpointManifest,
    load_causal_lm,
    save_checkpoint,
    verify_checkpoint,
)
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.perturbation import (
    ExternalPairSpec,
    PerturbationSpec,
    PerturbationSpecError,
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
    apply_perturbation,
    spec_to_json,
)

__all__ = ["ensure_perturbed_checkpoint", "write_perturbed_checkpoint"]


def write_perturbed_checkpoint(
    clean_dir: Path,
    spec: PerturbationSpec,
    dest: Path,
    *,
    source: str,
    replace: bool = False,
    cache_dir: Path | None = None,
) -> CheckpointManifest:
    """Write `clean_dir` perturbed by `spec` to `dest` (atomically) and return its manifest.

    A runtime-logit-noise spec leaves the weights as they are and is only recorded (the server's
    runtime noise processor applies it). The same spec on the same clean checkpoint gives
    byte-identical weights. Raises `PerturbationSpecError` for an external-pair spec (already
    perturbed elsewhere), `FileExistsError` if `dest` exists and not `replace`, and
    `CorruptCheckpointError` for a damaged clean checkpoint. A plain clean folder's identity is
    cached in `cache_dir` (default: the product's cache).
    """
    if isinstance(spec, ExternalPairSpec):
        raise PerturbationSpecError(
            "an external pair is already perturbed; pass its two paths to `calibrate` instead"
        )
    clean_identity = ModelIdentity.of_checkpoint(clean_dir, cache_dir)
    model, tokenizer = load_causal_lm(clean_dir)
    details: dict[str, object] = {}
    if not isinstance(spec, RuntimeLogitNoiseSpec):
        summary = apply_perturbation(model, spec)
        details = {
            "tensors": len(summary.tensors),
            "elements": summary.elements,
            "untied_output_head": summary.untied_output_head,
        }
    clean_name = clean_identity.name
    return save_checkpoint(
        dest,
        model,
        tokenizer,
        kind="perturbed",
        description=f"{clean_name} with {spec.label}",
        source=source,
        metadata={
            "perturbation": spec_to_json(spec),
            "clean": {"name": clean_name, "weights_sha256": clean_identity.weights_sha256},
            **details,
        },
        replace=replace,
    )


def ensure_perturbed_checkpoint(clean_dir: Path, spec: PerturbationSpec, cache_dir: Path) -> Path:
    """The checkpoint of `clean_dir` perturbed by the weight-changing `spec`, in the cache.

    Written once (atomically, with the spec in its metadata) under
    `cache_dir/served/<clean name>-<spec hash>`; later calls reuse it after the fast integrity
    check. Raises ValueError for a spec that does not change weights.
    """
    if not isinstance(spec, WeightNoiseSpec | QuantizationSpec):
        raise ValueError(
            f"only weight noise and quantization specs change weights, not {spec.kind}: "
            "runtime logit noise serves the clean weights, an external pair names its folders."
        )
    digest = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:12]
    dest = cache_dir / "served" / f"{clean_dir.name}-{digest}"
    if dest.exists():
        verify_checkpoint(dest, full=False)
        return dest
    write_perturbed_checkpoint(
        clean_dir,
        spec,
        dest,
        source=f"noisy-temp-server serve: {clean_dir} perturbed by the spec in metadata",
        cache_dir=cache_dir,
    )
    return dest
