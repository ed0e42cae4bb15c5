"""`CalibrationSettings`: how a calibration makes its data and fits its rules (recorded in the
profile for reproduction), and the `calibrate` flags generated from it.

Each field is one flag, ``--field-name``, whose help text is the field's docstring and whose
default is the field's (`add_calibration_arguments`); `calibration_settings_from_args` builds
the settings from the flags given, so names, help and defaults have one source.
"""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Callable
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from noisy_temp_server.adapter.layer_fit import DEFAULT_ADAPTER_RANK, AdapterMethod, reads_inputs
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = [
    "CalibrationSettings",
    "add_calibration_arguments",
    "calibration_settings_from_args",
    "settings_problems",
]

_NOT_FLAGS = ("prompts",)
"""Fields the command sets itself: `prompts` counts the prompts it loaded (``--num-prompts``)."""
_FLAG_CONSTANTS = {"adapter_rank": DEFAULT_ADAPTER_RANK}
"""Flags that may be given without a value, and the value they then take."""
_DEST_PREFIX = "calibration_"


class CalibrationSettings(BaseModel):
    """How the calibration data were made and the rules fitted (recorded for reproduction).

    Prompts are split three ways (`split_fit_validation_test`): `test_fraction` of them
    for the reported quality, `validation_fraction` for the choices, the rest to fit the rules
    on. The validation prompts are halved (`split_selection_gate`): the selection half chooses
    (the calibrated table's departures from T = 1 and from its constants, the bias's
    penalties), the gate half judges what was chosen (the recommended rule, the bias).
    Every position is measured at each of `request_temperatures` (KL to softmax(z/T_r), the
    clean model at the client's temperature): the calibrated table gets one band per request
    temperature, the other rules are fitted at T_r = 1, which must be among them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    prompts: int = Field(default=64, ge=2)
    """Prompts calibrated on."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Tokens of each sampled completion."""
    seed: int = 0
    """Sampling and split seed."""
    validation_fraction: float = Field(default=0.3, gt=0.0, lt=1.0)
    """Share of the prompts that choose the rule (and check the calibrated table)."""
    test_fraction: float = Field(default=0.3, gt=0.0, lt=1.0)
    """Share of the prompts that report the quality."""
    request_temperatures: tuple[float, ...] = (0.5, 0.7, 1.0, 1.2)
    """Request temperatures T_r every position is measured at (comma-separated), one
    calibrated band each, 1.0 included; a recommended bias must hold against the rule at each,
    so traffic at T_r = 1 alone calibrates with 1.0."""
    step_edges: tuple[int, ...] = (0, 4, 16, 64)
    """Generation steps where the rules' step buckets start (comma-separated, from 0)."""
    entropy_buckets: int = Field(default=4, ge=1)
    """Entropy buckets of the calibrated table."""
    min_cell_positions: int = Field(default=40, ge=1)
    """Positions a calibrated-table cell needs to depart from its constants."""
    min_quality_positions: int = Field(default=100, ge=1)
    """Positions a quality table needs."""
    t_min: float = 0.25
    """Lower bound on T*."""
    t_max: float = 4.0
    """Upper bound on T*."""
    bias_rows: int = Field(default=2048, ge=0)
    """Positions whose full clean and served rows fit the per-token bias (8 bytes per
    vocabulary entry each: 2048 rows of a 49k vocabulary take 800 MB); 0: no bias."""
    adapter_rank: int = Field(default=0, ge=0)
    """LoRA rank of the compensation adapter fitted first (weight-space correction of every
    perturbed linear layer, saved beside the profile in PEFT format; the rules and the bias are
    then fitted on top of it; docs/adapter.md says why the flag alone gives its rank); 0: none.
    Needs served weights that differ from the clean ones."""
    adapter_method: AdapterMethod = "propagated"
    """How the adapter is fitted (`adapter.layer_fit`): propagated (each layer fitted to give
    the clean model's outputs on its inputs), eora (each layer's own error, weighted by its
    inputs) or svd (plain SVD of each layer's error)."""
    adapter_fit_completions: int = Field(default=1, ge=1)
    """Completions of each fit and selection prompt the kept adapter is refitted on, once its
    ridge is chosen: the one calibration samples, and the others sampled without the adapter
    (its gain and cost: docs/adapter.md)."""
    adapter_distil_epochs: int = Field(default=0, ge=0)
    """Epochs of end-to-end distillation of the fitted adapter on the clean model's next-token
    distributions (`adapter.distillation`), the epoch kept chosen on the selection half (its
    gain and cost: docs/adapter.md); 0: none."""
    adapter_distil_completions: int = Field(default=4, ge=1)
    """Completions of each fit prompt the distillation trains on: the one calibration samples
    without the adapter, and the others sampled with it."""
    served_rows: Literal["auto", "model", "engine"] = "auto"
    """Where the served rows come from: model (transformers' forward of the served model),
    engine (vLLM's engine serving the served folder samples the completions and gives each
    position's row, `scoring.engine_rows`; no adapter) or auto: engine for a W8A8 int8
    checkpoint, whose kernels transformers does not reproduce, unless an adapter is fitted
    (the profile records the choice made)."""

    @model_validator(mode="after")
    def _check_consistency(self) -> Self:
        """Request temperatures, bounds and step edges as `TemperaturePolicy` accepts them,
        some prompts left to fit on, and the adapter's options only with an adapter they apply
        to (ValueError otherwise)."""
        temperatures = self.request_temperatures
        if (
            1.0 not in temperatures
            or any(not 0 < t < math.inf for t in temperatures)
            or list(temperatures) != sorted(set(temperatures))
        ):
            raise ValueError(
                f"request_temperatures {temperatures} must be ascending, distinct, finite, > 0 "
                "and include 1.0 (the reference the other rules are fitted at)"
            )
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                f"validation_fraction ({self.validation_fraction}) + test_fraction "
                f"({self.test_fraction}) must be < 1: the rest of the prompts fit the rules"
            )
        if self.served_rows == "engine" and self.adapter_rank:
            raise ValueError(
                "the engine's rows are the served model's without an adapter: calibrate an "
                "adapter with served_rows model"
            )
        if self.adapter_distil_epochs and not self.adapter_rank:
            raise ValueError("adapter distillation needs an adapter: give adapter_rank > 0")
        if self.adapter_fit_completions > 1 and (
            not self.adapter_rank or not reads_inputs(self.adapter_method)
        ):
            raise ValueError(
                "adapter_fit_completions > 1 needs an adapter fitted on its inputs: give "
                "adapter_rank > 0 and the propagated or eora method"
            )
        buckets = len(self.step_edges)
        TemperaturePolicy(
            bounds=self.bounds,
            step_edges=self.step_edges,
            alpha_by_step=(0.0,) * buckets,
            sigma2_by_step=(0.0,) * buckets,
        )
        return self

    @property
    def bounds(self) -> TemperatureBounds:
        return TemperatureBounds(self.t_min, self.t_max)


def settings_problems(error: ValidationError) -> str:
    """One line naming every problem `error` found in calibration settings:
    ``field: message; ...`` (``settings: ...`` for the checks of several fields)."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in error.errors()
    )


def _comma_separated(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """A flag type reading comma-separated values of `kind` (argparse reports a ValueError as
    a usage error; the settings check the rest)."""

    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(part) for part in text.split(",") if part.strip())

    return parse


def _flag_options(annotation: Any) -> dict[str, Any]:
    """argparse's `type` (and `choices`) for a field of `annotation`."""
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": typing.get_args(annotation)}
    if typing.get_origin(annotation) is tuple:
        return {"type": _comma_separated(typing.get_args(annotation)[0])}
    return {"type": annotation}


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a ``--field-name`` flag for each `CalibrationSettings` field (but `prompts`), its
    help the field's docstring with its default; flags not given leave the field's default."""
    group = parser.add_argument_group("calibration settings")
    for name, info in CalibrationSettings.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        default = info.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        options = _flag_options(info.annotation)
        if name in _FLAG_CONSTANTS:
            options |= {"nargs": "?", "const": _FLAG_CONSTANTS[name]}
            shown = f"{shown}; the flag alone: {_FLAG_CONSTANTS[name]}"
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=_DEST_PREFIX + name,
            default=argparse.SUPPRESS,
            metavar=name.upper() if "choices" not in options else None,
            help=f"{info.description} (default: {shown})".replace("%", "%%"),
            **options,
        )


def calibration_settings_from_args(args: argparse.Namespace, prompts: int) -> CalibrationSettings:
    """`CalibrationSettings` for `prompts` prompts from the flags `add_calibration_arguments`
    added that were given. Raises pydantic's `ValidationError` naming every bad field."""
    given = {
        key.removeprefix(_DEST_PREFIX): value
        for key, value in vars(args).items()
        if key.startswith(_DEST_PREFIX)
    }
    return CalibrationSettings(prompts=prompts, **given)
