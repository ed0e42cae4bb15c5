"""The profile file: what calibration measured about one clean/served pair, and how to serve it.

A profile (JSON, `Profile.save` / `Profile.load`) records the pair's identity (`ModelIdentity`:
name and weights sha256 of both models, and for a perturbed one the clean weights' sha256 and
the spec, so a profile calibrated with the perturbation applied in memory is accepted for the
checkpoint `perturb` or `serve` writes for the same spec), the perturbation spec, the calibration
settings, alpha / sigma2 / tau2 by generation-step bucket, the fitted parameters of every rule
(the calibrated table among them) and the quality tables of the validation prompts' gate half
(which gated the recommended rule) and of the test split (which reports it).
`Profile.to_policy(rule)` turns it into the `TemperaturePolicy` the server applies.

`schema_version` is checked on load: a profile written by another schema is refused, not
guessed at. So is one that names a head map (a correction earlier versions could fit under the
bias, since removed: docs/quality.md): its bias cannot be served as calibrated without it. The
head-map fields those versions wrote with no map (null, rank 0) are dropped on load. Every
failure to use a profile (unreadable file, bad JSON, wrong schema version, a head map, failed
validation, a pair that is not the one served) raises `ProfileError`, whose message names the
file and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from noisy_temp_server.adapter.layer_fit import AdapterMethod
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.files import write_atomically
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "AdapterDistillation",
    "AdapterSummary",
    "BiasSummary",
    "ModelIdentity",
    "Profile",
    "ProfileError",
    "QualityRow",
    "QualityTable",
    "RuleParameters",
    "StepBucketNoise",
]

PROFILE_SCHEMA_VERSION = 2

_HEAD_MAP_FIELDS = ("head_map_rank", "head_map", "head_map_penalty")
"""Fields of the removed head map (settings: the rank; bias: hash, rank, penalty)."""


class ProfileError(ValueError):
    """A profile that cannot be used: unreadable, corrupt, another schema, or another pair."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepBucketNoise(_Frozen):
    """Noise of one generation-step bucket [step_start, step_stop) (stop None: open-ended).

    alpha = mean sigma2 / mean tau2 over the bucket's positions (a ratio of means, robust to
    positions with a tiny tau2).
    """

    step_start: int
    step_stop: int | None
    positions: int
    alpha: float
    sigma2: float
    tau2: float


class RuleParameters(_Frozen):
    """Fitted parameters of every rule (the fields of `TemperaturePolicy`, less rule/version).

    Validated as `TemperaturePolicy` validates them (finite, positive temperatures, bounds with
    0 < t_min <= 1 <= t_max, one value per step bucket, a table of the edges' shape): every
    rule's policy is built once on construction, so invalid parameters fail here (ValueError
    naming the field), never later when a policy is served.
    """

    t_min: float
    t_max: float
    fixed_temperature: float
    step_edges: tuple[int, ...]
    alpha_by_step: tuple[float, ...]
    sigma2_by_step: tuple[float, ...]
    fisher_var_floor: float
    schedule_t_max: float
    schedule_beta: float
    calibrated_step_edges: tuple[int, ...]
    calibrated_entropy_edges: tuple[float, ...]
    calibrated_request_temperature_edges: tuple[float, ...]
    calibrated_temperatures: tuple[tuple[tuple[float, ...], ...], ...]

    @model_validator(mode="after")
    def _check_every_policy(self) -> Self:
        for rule in Rule:
            self.to_policy(rule)
        return self

    def to_policy(self, rule: Rule | str, version: int = 0) -> TemperaturePolicy:
        """The policy applying `rule` with these parameters."""
        return TemperaturePolicy(
            version=version,
            rule=Rule(rule),
            bounds=TemperatureBounds(self.t_min, self.t_max),
            fixed_temperature=self.fixed_temperature,
            step_edges=self.step_edges,
            alpha_by_step=self.alpha_by_step,
            sigma2_by_step=self.sigma2_by_step,
            fisher_var_floor=self.fisher_var_floor,
            schedule_t_max=self.schedule_t_max,
            schedule_beta=self.schedule_beta,
            calibrated=CalibratedTable(
                step_edges=self.calibrated_step_edges,
                entropy_edges=self.calibrated_entropy_edges,
                temperatures=self.calibrated_temperatures,
                request_temperature_edges=self.calibrated_request_temperature_edges,
            ),
        )


class QualityRow(_Frozen):
    """KL(p || served at the row's T) over the positions of one split.

    `stderr` is cluster-robust by sequence; `gain` is the mean paired improvement over T = 1,
    KL(T=1) - KL(row) position by position, and `gain_stderr` its cluster-robust standard error
    (paired, so much smaller than the two rows' own standard errors); `closure` =
    (KL(T=1) - KL) / (KL(T=1) - KL(oracle)), None when the oracle gains nothing over T = 1;
    `mean_temperature` is the mean T served. `gain_over_fixed` (± `gain_over_fixed_stderr`)
    is the same paired gain over the fitted `fixed` rule, KL(fixed) - KL(row), for the rules
    other than `fixed` when the table has a `fixed` row (else None): a rule is "not behind the
    constant" when this gain plus 2 standard errors is >= 0 (`is_not_worse`).
    """

    name: str
    mean_kl: float
    stderr: float
    gain: float
    gain_stderr: float
    p50: float
    p90: float
    p99: float
    closure: float | None
    mean_temperature: float
    gain_over_fixed: float | None = None
    gain_over_fixed_stderr: float | None = None

    @property
    def baseline_kl(self) -> float:
        """Mean KL of what `gain` is measured against (T = 1; for an adapter row, the served
        model without the adapter) on the same positions: `mean_kl` + `gain`."""
        return self.mean_kl + self.gain


class QualityTable(_Frozen):
    """Quality of T = 1, every rule, calibrated and the oracle on one split of the prompts.

    `split` says which: "validation" (the validation prompts' gate half, where the recommended
    rule was chosen, on rows that chose nothing else) or
    "test" (prompts used for nothing else: the honest figure). `request_temperatures`: the
    request temperatures T_r its positions were measured at (KL to softmax(z/T_r)); with
    several, each position counts once per T_r and the standard errors stay clustered by
    prompt. The same-top-token rate (served argmax == clean argmax, with its binomial standard
    error) does not depend on temperature, so it is reported once for the pair.
    """

    split: Literal["validation", "test"]
    request_temperatures: tuple[float, ...]
    positions: int
    sequences: int
    same_top_rate: float
    same_top_stderr: float
    rows: tuple[QualityRow, ...]

    def row(self, name: str) -> QualityRow:
        """The row called `name` (KeyError listing the names if there is none)."""
        for candidate in self.rows:
            if candidate.name == name:
                return candidate
        raise KeyError(f"no quality row {name!r}; rows: {[r.name for r in self.rows]}")

    def to_markdown(self) -> str:
        """The table as GitHub markdown, KL in units of 1e-3 nats."""
        lines = [
            f"{self.split.capitalize()} split at request temperature "
            f"{', '.join(f'{t:g}' for t in self.request_temperatures)}: {self.positions} "
            f"positions in {self.sequences} sequences; same top token "
            f"{100 * self.same_top_rate:.2f}% ± {100 * self.same_top_stderr:.2f}% "
            "(temperature-invariant).",
            "",
            "| T rule | mean KL (1e-3) | ± s.e. | gain vs T=1 ± paired s.e. | gain vs fixed "
            "± paired s.e. | p50 | p90 | p99 | closure | mean T |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            closure = "–" if r.closure is None else f"{100 * r.closure:.1f}%"
            over_fixed = (
                "–"
                if r.gain_over_fixed is None or r.gain_over_fixed_stderr is None
                else f"{1e3 * r.gain_over_fixed:+.3f} ± {1e3 * r.gain_over_fixed_stderr:.3f}"
            )
            lines.append(
                f"| {r.name} | {1e3 * r.mean_kl:.3f} | {1e3 * r.stderr:.3f} "
                f"| {1e3 * r.gain:+.3f} ± {1e3 * r.gain_stderr:.3f} | {over_fixed} "
                f"| {1e3 * r.p50:.3f} | {1e3 * r.p90:.3f} | {1e3 * r.p99:.3f} | {closure} "
                f"| {r.mean_temperature:.3f} |"
            )
        return "\n".join(lines) + "\n"


class BiasSummary(_Frozen):
    """The per-token logit bias + T fitted by calibration (`calibration.bias_fit`).

    The vector (float32, `vocab_size`) is stored next to the profile in
    `bias_file_name(sha256)`; `sha256` is its content hash. `head_penalty` is the L2 penalty
    of its part in the span of the clean model's output head (None: no such part);
    `penalty` the per-token L2 penalty of its free part, or, when it has none, the one best on
    validation, which the online refinement uses (both None: the T-only fit won on
    validation, the bias is 0). `recommended` when it is a bias, its gain over T = 1 on the
    validation prompts' gate half is significant, and it is not significantly worse there
    than `rule`, the recommended temperature rule it was compared with on the same rows
    (`gain_over_rule` ± `gain_over_rule_stderr`: KL(rule) - KL(bias), both exact, at the
    request temperature `gain_over_rule_request_temperature` where the bias is furthest behind
    the rule among the profile's request temperatures; None in profiles written before the
    comparison); then
    `Profile.to_policy()` serves it in place of that rule, at each of the settings' request
    temperatures with its T there, `band_temperatures` (T_r = 1: `temperature`; the others
    fitted with the bias held fixed, `bias_fit.fit_band_temperatures`; None in profiles written
    before them, which serve `temperature` at every one). Quality rows as in `QualityTable`, on
    the rows kept for the bias (`CalibrationSettings.bias_rows`); a bias can change the top
    token, so its same-top rates are its own. `fitted_rows`: the rows the served bias was fitted
    on (the online refinement counts them as already seen; None in profiles written before it
    was recorded, when the refinement counts `CalibrationSettings.bias_rows`).
    """

    sha256: str
    vocab_size: int
    temperature: float
    penalty: float | None
    recommended: bool
    validation: QualityRow
    test: QualityRow
    validation_same_top_rate: float
    test_same_top_rate: float
    head_penalty: float | None = None
    fitted_rows: int | None = Field(default=None, ge=0)
    rule: Rule | None = None
    gain_over_rule: float | None = None
    gain_over_rule_stderr: float | None = None
    gain_over_rule_request_temperature: float | None = None
    band_temperatures: tuple[float, ...] | None = None

    def served_temperatures(self, request_temperatures: Sequence[float]) -> dict[float, float]:
        """{T_r: the T served with the bias} at each of `request_temperatures` (the
        profile's): `band_temperatures`, or `temperature` at every one in profiles written
        before them."""
        if self.band_temperatures is None:
            return dict.fromkeys(request_temperatures, self.temperature)
        if len(self.band_temperatures) != len(request_temperatures):
            raise ValueError(
                f"{len(self.band_temperatures)} bias temperatures for "
                f"{len(request_temperatures)} request temperatures"
            )
        return dict(zip(request_temperatures, self.band_temperatures, strict=True))


class AdapterDistillation(_Frozen):
    """How the adapter was distilled after its fit: `epochs` run, `kept_epoch` the one whose
    adapter is kept (0: none beat the fit), `selection_kl` the mean KL at T = 1 on the
    selection half before the first epoch and after each."""

    epochs: int = Field(ge=1)
    kept_epoch: int = Field(ge=0)
    selection_kl: tuple[float, ...]

    def describe(self) -> str:
        """One phrase for reports: "distilled 4 epochs, epoch 3 kept (selection KL at T=1
        98.2 -> 90.5 e-3)"."""
        kept = self.selection_kl[self.kept_epoch]
        return (
            f"distilled {self.epochs} epochs, epoch {self.kept_epoch} kept (selection KL at T=1 "
            f"{1e3 * self.selection_kl[0]:.1f} -> {1e3 * kept:.1f} e-3)"
        )


class AdapterSummary(_Frozen):
    """The compensation adapter fitted by calibration (`adapter.lora`), served under
    everything else the profile names: the rules and the bias were fitted on rows served with
    it.

    The adapter is stored beside the profile in PEFT's LoRA format, in the folder
    `adapter_folder_name(sha256)`; `sha256` is its content hash. `rank` is the LoRA rank,
    `target_modules` the short names of the corrected modules, `layers` how many linear layers
    it corrects, `method` how it was fitted (`CalibrationSettings.adapter_method`), `ridge` the
    relative ridge chosen for it (``eora``: added to each input covariance; ``propagated``:
    pulling each layer's target towards its own error; None for ``svd``), `distillation` how
    it was then distilled (None: not). `recommended`: its
    gain over the served model without it (both at T = 1) on the validation prompts is
    significant; a profile whose adapter is not recommended serves none. Quality rows as in
    `QualityTable`: KL of the served model with the adapter at T = 1 against the served model
    without it.
    """

    sha256: str
    rank: int = Field(ge=1)
    target_modules: tuple[str, ...]
    layers: int = Field(ge=1)
    method: AdapterMethod
    ridge: float | None = Field(default=None, ge=0)
    distillation: AdapterDistillation | None = None
    recommended: bool
    validation: QualityRow
    test: QualityRow


class Profile(_Frozen):
    """Everything calibration learnt about one pair (see the module docstring).

    Rules are fitted on the fit split. `recommended_rule` (what `to_policy()` serves by
    default) is chosen on `validation_quality`, the validation prompts' gate half (the
    selection half chose the calibrated table's cells): the fitted rule with the lowest mean
    KL there among those whose paired gain over T = 1 is material (gain - 2 s.e. > 0 and
    gain > 0.1 % of KL(T = 1)), `off` when none is
    (`noisy_temp_server.calibration.quality.recommend_rule`). `test_quality`, on prompts
    used for neither, is the figure to report. Both pool the calibration's request
    temperatures; `test_quality_by_request_temperature` has one test table per temperature.
    """

    schema_version: Literal[2] = 2
    clean: ModelIdentity
    served: ModelIdentity
    perturbation: PerturbationSpec | None
    settings: CalibrationSettings
    noise_by_step: tuple[StepBucketNoise, ...]
    parameters: RuleParameters
    recommended_rule: Rule
    validation_quality: QualityTable
    test_quality: QualityTable
    test_quality_by_request_temperature: tuple[QualityTable, ...]
    bias: BiasSummary | None = None
    adapter: AdapterSummary | None = None

    @model_validator(mode="after")
    def _check_bias_bands(self) -> Self:
        """A bias's band temperatures, one per request temperature (ValueError otherwise)."""
        if self.bias is not None:
            self.bias.served_temperatures(self.settings.request_temperatures)
        return self

    def to_policy(self, rule: Rule | str | None = None, version: int = 0) -> TemperaturePolicy:
        """The policy for `rule` with the fitted parameters. By default the recommendation:
        when the bias is recommended (it beat T = 1 and was not behind `recommended_rule` on
        the same rows at any of the profile's request temperatures), the per-token bias with
        its own T in one band per request temperature (rule `calibrated`: the combination
        calibration measured; `fixed` with its one T when it has no bands), else
        `recommended_rule`. The bias's bands replace the rule's: a band's T, fitted without
        the bias, does not apply on top of it."""
        if rule is None and self.bias is not None and self.bias.recommended:
            return self._bias_policy(self.bias, version)
        return self.parameters.to_policy(self.recommended_rule if rule is None else rule, version)

    def _bias_policy(self, bias: BiasSummary, version: int) -> TemperaturePolicy:
        bands = bias.served_temperatures(self.settings.request_temperatures)
        return self.parameters.to_policy(Rule.CALIBRATED, version).serving_bias(bias.sha256, bands)

    def save(self, path: Path) -> None:
        """Write the profile as indented JSON (`write_atomically`)."""
        write_atomically(path, (self.model_dump_json(indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> Profile:
        """Read and validate a profile; `ProfileError` naming the file and the problem."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ProfileError(f"cannot read profile {path}: {error}") from error
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProfileError(
                f"profile {path} is not valid JSON ({error}); recreate it with "
                "`noisy-temp-server calibrate`"
            ) from error
        version = document.get("schema_version") if isinstance(document, dict) else None
        if version != PROFILE_SCHEMA_VERSION:
            raise ProfileError(
                f"profile {path} has schema_version {version!r}, this noisy-temp-server reads "
                f"version {PROFILE_SCHEMA_VERSION}; recreate it with `noisy-temp-server calibrate`"
            )
        _drop_removed_head_map(path, document)
        try:
            return cls.model_validate(document)
        except ValidationError as error:
            raise ProfileError(
                f"profile {path} failed validation (recreate it with `noisy-temp-server "
                f"calibrate`): {error}"
            ) from error

    def check_pair(self, clean: ModelIdentity, served: ModelIdentity) -> None:
        """Raise `ProfileError` unless this profile was measured on this pair: each recorded
        identity must `match` the actual one (same weights, or the same perturbation of the
        same clean weights)."""
        for role, recorded, actual in (
            ("clean", self.clean, clean),
            ("served", self.served, served),
        ):
            if not recorded.matches(actual):
                raise ProfileError(
                    f"the profile was calibrated for {role} model {recorded.describe()}, but the "
                    f"{role} model is {actual.describe()}; calibrate this pair with "
                    "`noisy-temp-server calibrate`"
                )

    @classmethod
    def load_for_pair(cls, path: Path, clean: ModelIdentity, served: ModelIdentity) -> Profile:
        """`load`, then `check_pair` (its `ProfileError` then names the file as well)."""
        profile = cls.load(path)
        try:
            profile.check_pair(clean, served)
        except ProfileError as error:
            raise ProfileError(f"profile {path}: {error}") from error
        return profile


def _drop_removed_head_map(path: Path, document: dict[str, Any]) -> None:
    """Drop, in place, the head-map fields earlier versions wrote with no map (the settings'
    `head_map_rank` 0; the bias's `head_map`, `head_map_rank`, `head_map_penalty` null);
    `ProfileError` when they record a map, which is no longer served."""
    settings, bias = document.get("settings"), document.get("bias")
    sections = [part for part in (settings, bias) if isinstance(part, dict)]
    removed = [part.pop(key) for part in sections for key in _HEAD_MAP_FIELDS if key in part]
    if any(removed):
        raise ProfileError(
            f"profile {path} was calibrated with a head map under its bias, which "
            'noisy-temp-server no longer serves (docs/quality.md, "The head map (removed)"); '
            "recalibrate the pair with `noisy-temp-server calibrate`"
        )
