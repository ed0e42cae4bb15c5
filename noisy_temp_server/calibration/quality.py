"""The quality table of one split of the prompts, and the rule it recommends.

Calibration builds two: on the validation split (it chooses the recommended rule,
`recommend_rule`) and on the test split (it reports it, untouched by any choice). KL of a rule
at a position is read off the position's KL curve at the rule's T (`interpolate_kl`, within
about 0.2% of the exact KL); T = 1 and the oracle use the exact values. Standard errors of mean
KL, and of the paired gains KL(T=1) - KL(rule) that decide significance, are cluster-robust by
sequence (`noisy_temp_server.calibration.significance`). Every rule other than `fixed` also gets
its paired gain over the fitted constant, KL(fixed) - KL(rule), with its clustered standard
error: "not behind the constant" means that gain + 2 s.e. >= 0. The same-top-token rate gets the
binomial standard error. Temperature never changes the argmax, so that rate is a property of
the pair, the same for every rule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from noisy_temp_server.calibration.curves import request_temperatures_of
from noisy_temp_server.calibration.fitting import FITTED_RULES, finite_positions, rule_temperatures
from noisy_temp_server.calibration.profile import QualityRow, QualityTable
from noisy_temp_server.calibration.significance import (
    InsufficientDataError,
    is_material_gain,
)
from noisy_temp_server.scoring.records import PositionRecords, interpolate_kl
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

__all__ = ["quality_row", "quality_table", "recommend_rule"]


def quality_row(
    name: str,
    *,
    kl: Tensor,
    temperatures: Tensor,
    sequence_ids: Tensor,
    kl_at_one: Tensor,
    kl_one: float,
    kl_oracle: float,
    kl_fixed: Tensor | None,
) -> QualityRow:
    """The row `name` of per-position `kl` [N] served at `temperatures` [N]: paired with
    `kl_at_one` [N] (the same positions at T = 1) for the gain, clustered by `sequence_ids`;
    closure against the mean KL at T = 1 and of the oracle over these positions."""
    kl = kl.double()
    mean = float(kl.mean())
    percentiles = torch.quantile(kl, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    gap = kl_one - kl_oracle
    gain = kl_at_one.double() - kl
    over_fixed = None if kl_fixed is None else kl_fixed.double() - kl
    return QualityRow(
        name=name,
        mean_kl=mean,
        stderr=cluster_stderr(kl, sequence_ids),
        gain=float(gain.mean()),
        gain_stderr=cluster_stderr(gain, sequence_ids),
        p50=percentiles[0],
        p90=percentiles[1],
        p99=percentiles[2],
        closure=(kl_one - mean) / gap if gap > 0 else None,
        mean_temperature=float(temperatures.double().mean()),
        gain_over_fixed=None if over_fixed is None else float(over_fixed.mean()),
        gain_over_fixed_stderr=(
            None if over_fixed is None else cluster_stderr(over_fixed, sequence_ids)
        ),
    )


def quality_table(
    records: PositionRecords,
    policies: Sequence[TemperaturePolicy],
    min_positions: int = 100,
    *,
    split: Literal["validation", "test"],
) -> QualityTable:
    """The quality table on `records` (one split, named by `split`): T = 1, each policy's rule,
    and the oracle.

    Rows are named by rule value (give at most one policy per rule), with "T=1" and "oracle".
    When a `fixed` policy is among `policies`, the other policies' rows carry their paired gain
    over it (`QualityRow.gain_over_fixed`).

    Positions whose KL is infinite at every T (the served row masks a token the clean row
    supports) are left out. Raises `InsufficientDataError` below `min_positions` positions.
    """
    records = finite_positions(records)
    if len(records) < min_positions:
        raise InsufficientDataError(
            f"only {len(records)} {split} positions with finite KL; the quality table needs at "
            f"least {min_positions}: use more prompts or longer completions"
        )
    ones = torch.ones(len(records))
    kl_one = float(records.kl_at_one.double().mean())
    kl_oracle = float(records.oracle_kl.double().mean())
    ids = records.sequence_id
    row = functools.partial(
        quality_row,
        sequence_ids=ids,
        kl_at_one=records.kl_at_one,
        kl_one=kl_one,
        kl_oracle=kl_oracle,
    )
    served = {}
    for policy in policies:
        t = rule_temperatures(policy, records)
        served[policy.rule] = (t, interpolate_kl(records.kl_curve, records.curve_temperatures, t))
    kl_fixed = served[Rule.FIXED][1] if Rule.FIXED in served else None
    rows = [row("T=1", kl=records.kl_at_one, temperatures=ones, kl_fixed=None)]
    for rule, (t, kl) in served.items():
        versus = None if rule is Rule.FIXED else kl_fixed
        rows.append(row(rule.value, kl=kl, temperatures=t, kl_fixed=versus))
    rows.append(row("oracle", kl=records.oracle_kl, temperatures=records.oracle_t, kl_fixed=None))
    same = records.same_top.double()
    rate = float(same.mean())
    return QualityTable(
        split=split,
        request_temperatures=request_temperatures_of(records),
        positions=len(records),
        sequences=int(torch.unique(ids).numel()),
        same_top_rate=rate,
        same_top_stderr=math.sqrt(rate * (1 - rate) / len(records)),
        rows=tuple(rows),
    )


def recommend_rule(quality: QualityTable, rules: Sequence[Rule] = FITTED_RULES) -> Rule:
    """The rule to serve: among `rules` (rows of `quality`, the validation split), the one with
    the lowest mean KL among those whose paired gain over T = 1 is material (`is_material_gain`:
    significant, and above `MIN_RELATIVE_GAIN` of KL(T = 1), since a rule's KL is read off the
    KL curves and T = 1's is exact); `Rule.OFF` when none is.

    A rule that looks better than T = 1 only by noise, or by the curves' interpolation error,
    is never recommended, so the served rule is not worse than T = 1 beyond statistical
    noise. (Six rules are tested at about 2 standard
    errors each; the choice favours the rule that got lucky on these prompts, which is why the
    quality reported for it comes from a test split that took no part in it.)
    """
    kl_one = quality.row("T=1").mean_kl
    significant = [
        row
        for row in (quality.row(rule.value) for rule in rules)
        if is_material_gain(row.gain, row.gain_stderr, kl_one)
    ]
    if not significant:
        return Rule.OFF
    return Rule(min(significant, key=lambda row: row.mean_kl).name)
