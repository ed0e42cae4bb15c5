"""Calibrate a pair and write what serving reads: the profile, the recommended policy beside it
(`<profile stem>.policy.json`, what ``NTS_POLICY_FILE`` reads), the bias vector
(`bias-<sha256>.safetensors`) and the compensation adapter (`adapter-<hash>/`, PEFT LoRA) when
they were fitted, and optionally the per-position records. `calibration_text` is what
`calibrate` prints of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from noisy_temp_server.adapter.lora import save_peft_adapter
from noisy_temp_server.calibration.adapter_calibration import AdapterCalibration
from noisy_temp_server.calibration.pipeline import CalibrationResult, calibrate
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.loading import ServedWeights, load_pair
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.correction.files import save_bias_file
from noisy_temp_server.files import write_atomically
from noisy_temp_server.scoring.records import PositionRecords

__all__ = ["CalibratedFiles", "adapter_text", "calibrate_to_files", "calibration_text"]


@dataclass(frozen=True)
class CalibratedFiles:
    """A calibration's result and the files written for it."""

    result: CalibrationResult
    profile: Path
    policy: Path


def calibrate_to_files(
    clean: Path,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    out: Path,
    *,
    served: Path | None = None,
    spec: PerturbationSpec | None = None,
    device: str = "cpu",
    records: Path | None = None,
    cache_dir: Path | None = None,
    served_weights: ServedWeights = "auto",
) -> CalibratedFiles:
    """Calibrate the pair of `clean` and `served` (or `spec` applied to `clean` in memory) on
    `prompts` under `settings`, and write the profile to `out` with its files beside it (module
    docstring), then the records to `records` when given. The bias and adapter files are
    written before the profile, so a profile never names a file not yet written. The pair is
    checked before any model work (`load_pair`; plain folders' identities cached in
    `cache_dir`; a quantized served model loaded as `served_weights` says). Raises ValueError
    (bad input, a bad folder or pair: `ModelFolderError`), OSError and
    `CorruptCheckpointError`."""
    pair = load_pair(
        clean, served_path=served, spec=spec, device=device,
        same_architecture=settings.adapter_rank > 0, cache_dir=cache_dir,
        served_weights=served_weights,
    )  # fmt: skip
    result = calibrate(pair, prompts, settings, device=device)
    if result.bias is not None:
        save_bias_file(out.parent, result.bias.correction.bias)
    if result.adapter is not None:
        save_peft_adapter(out.parent, result.adapter.adapter)
    result.profile.save(out)
    policy = out.with_name(f"{out.stem}.policy.json")
    write_atomically(policy, (result.profile.to_policy().to_json() + "\n").encode())
    if records is not None:
        PositionRecords.concat([result.fit, result.validation, result.test]).save(records)
    return CalibratedFiles(result, out, policy)


def _gain_words(gain: float, stderr: float) -> str:
    """How a stage's gain on the gate half reads: what it removes or adds, at 2 s.e."""
    if gain > 2 * stderr:
        return "its gain over 2 s.e."
    if gain < -2 * stderr:
        return f"it raises KL by {1e3 * -gain:.3f}e-3, over 2 s.e."
    return "its gain within 2 s.e."


def adapter_text(calibration: AdapterCalibration) -> str:
    """The adapter's fit and quality, as printed by `calibrate`: the ridge chosen on the
    selection half, then served + adapter against served, both at T = 1, on the gate half and
    the test prompts, with the share of KL(T = 1) removed."""
    summary = calibration.summary
    tried = ", ".join(
        f"{'-' if ridge is None else f'{ridge:g}'}: {1e3 * kl:.3f}"
        for ridge, kl in calibration.selection_kl.items()
    )
    gate = summary.validation
    lines = [
        f"Adapter: rank {summary.rank} {summary.method}, {summary.layers} layers "
        f"({', '.join(summary.target_modules)}), {calibration.adapter.parameter_count} "
        f"parameters, ridge {summary.ridge} (selection-half KL at T=1 (1e-3) by ridge: {tried}); "
        + ("" if summary.distillation is None else f"{summary.distillation.describe()}; ")
        + f"{'recommended' if summary.recommended else 'NOT recommended'} (on the gate half, "
        f"{_gain_words(gate.gain, gate.gain_stderr)})",
        "",
        "| split | KL served T=1 (1e-3) | KL served+adapter T=1 | gain ± paired s.e. "
        "| share removed |",
        "|---|---:|---:|---:|---:|",
    ]
    for split, row in (("validation (gate half)", summary.validation), ("test", summary.test)):
        base = row.mean_kl + row.gain
        share = row.gain / base if base > 0 else float("nan")
        lines.append(
            f"| {split} | {1e3 * base:.3f} | {1e3 * row.mean_kl:.3f} | {1e3 * row.gain:+.3f} ± "
            f"{1e3 * row.gain_stderr:.3f} | {100 * share:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def calibration_text(files: CalibratedFiles) -> str:
    """What `calibrate` prints: the adapter's table, the quality tables (validation gate half,
    test, test at each request temperature), the recommended rule and why, the bias's table and
    the policy file."""
    result = files.result
    profile = result.profile
    parts = [] if result.adapter is None else [adapter_text(result.adapter)]
    parts += [profile.validation_quality.to_markdown(), profile.test_quality.to_markdown()]
    parts += [table.to_markdown() for table in profile.test_quality_by_request_temperature]
    rule = profile.recommended_rule.value
    why = (
        "no rule's gain over T=1 on the validation gate half exceeds 2 standard errors "
        "and 0.1% of KL(T=1)"
        if rule == "off"
        else "the lowest validation KL among rules whose gain over T=1 exceeds 2 s.e. "
        "and 0.1% of KL(T=1); its test row is the figure to quote"
    )
    parts.append(f"recommended rule: {rule} ({why}); profile: {files.profile}")
    if result.bias is not None:
        parts.append(result.bias.to_markdown())
    parts.append(f"recommended policy (NTS_POLICY_FILE): {files.policy}")
    return "\n".join(parts)
