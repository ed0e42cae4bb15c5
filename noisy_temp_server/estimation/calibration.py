"""Calibration: generate with the served model, score the pair, fit every rule, measure it.

The pipeline (`calibrate`):

1. the served model samples a completion for every prompt at T = 1, as it would serve it
   (with its runtime logit noise, if the pair has one);
2. the pair scorer turns prompt + completion into per-position records;
3. prompts (not positions) are split into a fit set and a held-out set;
4. every rule is fitted on the fit set (`fit_rules`), all from the records' KL curves:
   `fixed` is the best shared T; `sqrt`/`linear` use alpha by step bucket (ratio of mean
   sigma2 to mean tau2 in the bucket); `fisher` uses sigma2 by step bucket and a fitted floor
   on Var_q; `schedule` fits (t_max, beta); `calibrated` is a `CalibratedTable` (see
   `fit_calibrated_table`);
5. the quality table (`quality_table`) compares T = 1, every rule, calibrated and the oracle on
   the held-out prompts;
6. the recommended rule (`recommend_rule`) is the lowest-KL rule whose paired held-out gain over
   T = 1 is significant, else `off`: no rule is served on the strength of noise.

KL of a rule at a position is read off the position's KL curve at the rule's T
(`interpolate_kl`, within about 0.2% of the exact KL); T = 1 and the oracle use the exact values.

Standard errors of mean KL are cluster-robust by sequence (positions of one completion are
correlated, so treating them as independent would overstate the evidence); so are those of the
paired gains KL(T=1) - KL(rule), which decide significance: a gain is significant when its mean
minus `SIGNIFICANCE_STDERRS` (2) standard errors is > 0. The same-top-token rate gets the
binomial standard error. Temperature never changes the argmax, so that rate is a
property of the pair, the same for every rule.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

from noisy_temp_server.estimation.profile import (
    CalibrationSettings,
    ModelIdentity,
    Profile,
    QualityRow,
    QualityTable,
    RuleParameters,
    StepBucketNoise,
)
from noisy_temp_server.estimation.prompts import Prompt, encode_prompt
from noisy_temp_server.pairs.checkpoint import load_causal_lm
from noisy_temp_server.pairs.perturb import (
    PerturbationSpec,
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
    add_runtime_logit_noise,
    apply_perturbation,
)
from noisy_temp_server.pairs.scorer import (
    PairScorer,
    PositionRecords,
    ScoringSequence,
    interpolate_kl,
)
from noisy_temp_server.temperature.policy import (
    TemperaturePolicy,
    bucket_index,
    policy_temperature,
)
from noisy_temp_server.temperature.rules import (
    Rule,
    TemperatureBounds,
    clamp_temperature,
    schedule_temperature,
)
from noisy_temp_server.temperature.stats import ServedRowFeatures

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "FITTED_RULES",
    "SIGNIFICANCE_STDERRS",
    "CalibrationResult",
    "InsufficientDataError",
    "LoadedPair",
    "best_curve_temperature",
    "calibrate",
    "calibrate_records",
    "fit_calibrated_table",
    "fit_rules",
    "generate_completions",
    "load_pair",
    "noise_by_step",
    "quality_table",
    "recommend_rule",
    "rule_temperatures",
    "score_pair",
    "split_by_sequence",
]

logger = logging.getLogger(__name__)

FITTED_RULES: tuple[Rule, ...] = (
    Rule.FIXED,
    Rule.SQRT,
    Rule.LINEAR,
    Rule.FISHER,
    Rule.SCHEDULE,
    Rule.CALIBRATED,
)
SIGNIFICANCE_STDERRS = 2.0
"""A gain is significant when its mean minus this many standard errors is > 0."""
_SEARCH_POINTS = 801
_FISHER_FLOORS = torch.logspace(-3, 3, 61)
_SCHEDULE_BETAS = torch.cat([torch.zeros(1), torch.logspace(-4, 1, 41)])
_SCHEDULE_T_MAX_POINTS = 97
_SCHEDULE_CHUNK_ROWS = 1 << 16


class InsufficientDataError(ValueError):
    """Too few positions (or sequences) to fit or to report on."""


def split_by_sequence(sequence_ids: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Split the distinct ids of `sequence_ids` [N] into two disjoint sets.

    Returns bool masks over the N rows: (first, second), the second holding about `fraction`
    of the sequences (at least one, and at least one left for the first). Deterministic in
    `seed`. Raises `InsufficientDataError` with fewer than two sequences.
    """
    ids = torch.unique(sequence_ids)
    if ids.numel() < 2:
        raise InsufficientDataError(
            f"need at least 2 sequences to split, got {ids.numel()}; use more prompts"
        )
    order = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))
    count = min(ids.numel() - 1, max(1, round(fraction * ids.numel())))
    second_ids = ids[order[:count]]
    second = torch.isin(sequence_ids, second_ids)
    return ~second, second


def _step_bucket(step: Tensor, edges: Sequence[int]) -> Tensor:
    return bucket_index(step, torch.tensor(edges, dtype=torch.int64))


def noise_by_step(records: PositionRecords, step_edges: Sequence[int]) -> list[StepBucketNoise]:
    """sigma2, tau2 and alpha = mean sigma2 / mean tau2 per step bucket (edges start at 0).

    An empty bucket takes the values of the nearest earlier non-empty one (the first non-empty
    bucket's values fill empty leading buckets), with `positions = 0`.
    """
    bucket = _step_bucket(records.step, step_edges)
    finite = torch.isfinite(records.sigma2) & torch.isfinite(records.tau2)
    measured: list[tuple[int, float, float]] = []
    for b in range(len(step_edges)):
        rows = (bucket == b) & finite
        count = int(rows.sum())
        if count:
            measured.append(
                (
                    count,
                    float(records.sigma2[rows].double().mean()),
                    float(records.tau2[rows].double().mean()),
                )
            )
        else:
            measured.append((0, math.nan, math.nan))
    if all(count == 0 for count, _, _ in measured):
        raise InsufficientDataError("no position with finite sigma2 and tau2 to estimate noise")
    first = next(m for m in measured if m[0])
    result = []
    previous = first
    for b, bucket_noise in enumerate(measured):
        count = bucket_noise[0]
        if count:
            previous = bucket_noise
        _, sigma2, tau2 = previous
        stop = step_edges[b + 1] if b + 1 < len(step_edges) else None
        result.append(
            StepBucketNoise(
                step_start=step_edges[b],
                step_stop=stop,
                positions=count,
                alpha=sigma2 / tau2 if tau2 > 0 else 0.0,
                sigma2=sigma2,
                tau2=tau2,
            )
        )
    return result


def _mean_kl(records: PositionRecords, temperatures: Tensor) -> Tensor:
    """Mean interpolated KL of `records` at per-row `temperatures` [N] -> scalar."""
    return (
        interpolate_kl(records.kl_curve, records.curve_temperatures, temperatures).double().mean()
    )


def best_curve_temperature(
    kl_curves: Tensor, curve_temperatures: Tensor, bounds: TemperatureBounds
) -> float:
    """The one T in `bounds` minimising the mean of the rows' interpolated KL curves.

    kl_curves: [N, G] (N >= 1). Interpolation is linear in the curve values, so this minimises
    the interpolated mean curve, searched on a fine log-spaced grid (801 points over the bounds).
    """
    if kl_curves.shape[0] == 0:
        raise InsufficientDataError("no positions to fit a temperature on")
    mean_curve = kl_curves.double().mean(dim=0, keepdim=True)  # [1, G]
    candidates = torch.exp(
        torch.linspace(
            math.log(bounds.t_min), math.log(bounds.t_max), _SEARCH_POINTS, dtype=torch.float64
        )
    )
    values = interpolate_kl(mean_curve.expand(_SEARCH_POINTS, -1), curve_temperatures, candidates)
    return float(candidates[int(values.argmin())])


def _cluster_stderr(values: Tensor, sequence_ids: Tensor) -> float:
    """Standard error of the mean of `values` [N], cluster-robust over `sequence_ids`."""
    count = values.shape[0]
    if count < 2:
        return math.inf
    centred = values.double() - values.double().mean()
    _, cluster = torch.unique(sequence_ids, return_inverse=True)
    sums = torch.zeros(int(cluster.max()) + 1, dtype=torch.float64).index_add_(0, cluster, centred)
    clusters = sums.shape[0]
    if clusters < 2:
        return math.inf
    correction = clusters / (clusters - 1)
    return math.sqrt(correction * float(sums.square().sum())) / count


def _is_significant(gain: float, stderr: float) -> bool:
    """Whether a mean gain with this standard error is significant (module docstring)."""
    return gain - SIGNIFICANCE_STDERRS * stderr > 0


def _entropy_edges(entropy: Tensor, buckets: int) -> tuple[float, ...]:
    """Edges (from 0) splitting the served entropy into `buckets` quantile buckets."""
    if buckets == 1 or entropy.numel() == 0:
        return (0.0,)
    quantiles = torch.quantile(entropy.double(), torch.linspace(0, 1, buckets + 1)[1:-1].double())
    edges = [0.0]
    for q in quantiles.tolist():
        if q > edges[-1] + 1e-6:
            edges.append(round(q, 6))
    return tuple(edges)


def _entropy_bucket(entropy: Tensor, edges: Sequence[float]) -> Tensor:
    return bucket_index(entropy.float(), torch.tensor(edges, dtype=torch.float32))


def _refined_temperature(
    parent: float,
    fit: PositionRecords,
    validation: PositionRecords,
    bounds: TemperatureBounds,
    min_positions: int,
) -> float:
    """The best shared T of `fit`, if it beats `parent` significantly on `validation`; else
    `parent`. Cells with fewer than `min_positions` positions in either set keep `parent`."""
    if min(len(fit), len(validation)) < min_positions:
        return parent
    candidate = best_curve_temperature(fit.kl_curve, fit.curve_temperatures, bounds)
    at_parent, at_candidate = (
        interpolate_kl(
            validation.kl_curve, validation.curve_temperatures, torch.full((len(validation),), t)
        ).double()
        for t in (parent, candidate)
    )
    gain = at_parent - at_candidate
    significant = _is_significant(float(gain.mean()), _cluster_stderr(gain, validation.sequence_id))
    return candidate if significant else parent


def fit_calibrated_table(
    fit: PositionRecords,
    validation: PositionRecords,
    *,
    step_edges: Sequence[int],
    entropy_buckets: int,
    bounds: TemperatureBounds,
    min_cell_positions: int,
) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """The calibrated table: one T per (step bucket, served-entropy bucket), fitted top-down.

    Every node of the hierarchy (all positions -> step bucket -> step bucket x entropy bucket)
    starts from its parent's T (the root's parent is T = 1). Its own T is the best shared T of
    its `fit` positions, kept only if the node has at least `min_cell_positions` positions in
    both sets and that T beats the parent's on the node's `validation` positions significantly
    (paired gain minus 2 cluster-robust standard errors > 0); otherwise the node inherits the
    parent's T. So a single global T is found whenever the evidence supports one, a split is
    made only where the cell's own evidence demands it, a cell with thin evidence takes the
    coarser estimate rather than 1, and with no evidence at all the table stays at T = 1: it
    never does worse than T = 1 beyond statistical noise. Entropy edges are quantiles of
    `fit`'s served entropy. Returns (entropy_edges, temperatures [step buckets][entropy
    buckets]).
    """
    entropy_edges = _entropy_edges(fit.served_entropy, entropy_buckets)
    refine = functools.partial(
        _refined_temperature, bounds=bounds, min_positions=min_cell_positions
    )
    fit_steps, validation_steps = (_step_bucket(r.step, step_edges) for r in (fit, validation))
    fit_entropy, validation_entropy = (
        _entropy_bucket(r.served_entropy, entropy_edges) for r in (fit, validation)
    )
    root = refine(1.0, fit, validation)
    table = []
    for s in range(len(step_edges)):
        step_fit, step_validation = fit_steps == s, validation_steps == s
        step_t = refine(root, fit.select(step_fit), validation.select(step_validation))
        table.append(
            tuple(
                refine(
                    step_t,
                    fit.select(step_fit & (fit_entropy == e)),
                    validation.select(step_validation & (validation_entropy == e)),
                )
                for e in range(len(entropy_edges))
            )
        )
    return entropy_edges, tuple(table)


def _fisher_floor(records: PositionRecords, fisher: TemperaturePolicy) -> float:
    """The Var_q floor (searched over 1e-3..1e3) minimising mean KL of the `fisher` policy."""
    best, best_kl = float(_FISHER_FLOORS[0]), math.inf
    for floor in _FISHER_FLOORS.tolist():
        candidate = dataclasses.replace(fisher, fisher_var_floor=floor)
        kl = float(_mean_kl(records, rule_temperatures(candidate, records)))
        if kl < best_kl:
            best, best_kl = floor, kl
    return best


def _schedule(records: PositionRecords, bounds: TemperatureBounds) -> tuple[float, float]:
    """(t_max, beta) of T(step) = t_max / sqrt(1 + beta step) minimising mean KL (grid search).

    Exact over all positions, evaluated a chunk of positions at a time so that the rows of one
    `interpolate_kl` call (t_max grid points x positions) stay below `_SCHEDULE_CHUNK_ROWS`:
    memory is bounded (tens of MB) whatever the number of positions.
    """
    t_max_grid = torch.exp(
        torch.linspace(math.log(bounds.t_min), math.log(bounds.t_max), _SCHEDULE_T_MAX_POINTS)
    )
    betas = _SCHEDULE_BETAS.tolist()
    kl_sums = torch.zeros(len(betas), len(t_max_grid), dtype=torch.float64)
    chunk = max(1, _SCHEDULE_CHUNK_ROWS // len(t_max_grid))
    for first in range(0, len(records), chunk):
        steps = records.step[first : first + chunk]
        curves = records.kl_curve[first : first + chunk]
        expanded = curves.unsqueeze(0).expand(len(t_max_grid), -1, -1).reshape(-1, curves.shape[-1])
        for b, beta in enumerate(betas):
            shape = schedule_temperature(steps, 1.0, beta)  # [chunk]
            t = clamp_temperature(t_max_grid[:, None] * shape[None, :], bounds.t_min, bounds.t_max)
            kl = interpolate_kl(expanded, records.curve_temperatures, t.reshape(-1))
            kl_sums[b] += kl.reshape(len(t_max_grid), -1).double().sum(dim=1)
    best = int(kl_sums.argmin())  # row-major: the smallest beta, then t_max, among ties
    beta_index, t_max_index = divmod(best, len(t_max_grid))
    return float(t_max_grid[t_max_index]), float(betas[beta_index])


def fit_rules(
    records: PositionRecords,
    settings: CalibrationSettings,
    rules: Collection[Rule] = FITTED_RULES,
) -> tuple[RuleParameters, list[StepBucketNoise]]:
    """Fit the parameters of `rules` (default: every rule) on `records` (the fit set; see the
    module docstring).

    The noise by step bucket (alpha and sigma2, all that `sqrt` and `linear` need) is always
    fitted; `fixed` adds the best shared T, `fisher` the Var_q floor, `schedule` (t_max, beta)
    and `calibrated` the table. The parameters of rules not in `rules` are the neutral ones of
    `TemperaturePolicy` (T = 1: fixed T 1, floor 1, schedule t_max 1 / beta 0, an all-ones
    table). The calibrated table is fitted on part of the sequences and checked on the others
    (`settings.validation_fraction`), so the held-out set stays untouched. Positions whose KL
    is infinite at every T (the served row masks a token the clean row supports) carry no
    information about T and are left out, as in `quality_table`. Raises
    `InsufficientDataError` when there is nothing to fit on (or, for `calibrated`, fewer than
    two sequences).
    """
    records = records.select(torch.isfinite(records.kl_at_one))
    bounds = settings.bounds
    step_edges = tuple(settings.step_edges)
    noise = noise_by_step(records, step_edges)
    alpha_by_step = tuple(max(n.alpha, 0.0) for n in noise)
    sigma2_by_step = tuple(max(n.sigma2, 0.0) for n in noise)
    neutral = TemperaturePolicy()
    entropy_edges: tuple[float, ...] = (0.0,)
    table: tuple[tuple[float, ...], ...] = tuple((1.0,) for _ in step_edges)
    if Rule.CALIBRATED in rules:
        table_fit, table_check = split_by_sequence(
            records.sequence_id, settings.validation_fraction, settings.seed + 1
        )
        entropy_edges, table = fit_calibrated_table(
            records.select(table_fit),
            records.select(table_check),
            step_edges=step_edges,
            entropy_buckets=settings.entropy_buckets,
            bounds=bounds,
            min_cell_positions=settings.min_cell_positions,
        )
    t_max, beta = (
        _schedule(records, bounds)
        if Rule.SCHEDULE in rules
        else (neutral.schedule_t_max, neutral.schedule_beta)
    )
    fixed_temperature = (
        best_curve_temperature(records.kl_curve, records.curve_temperatures, bounds)
        if Rule.FIXED in rules
        else neutral.fixed_temperature
    )
    fisher_var_floor = neutral.fisher_var_floor
    if Rule.FISHER in rules:
        fisher = TemperaturePolicy(
            rule=Rule.FISHER,
            bounds=bounds,
            step_edges=step_edges,
            alpha_by_step=alpha_by_step,
            sigma2_by_step=sigma2_by_step,
        )
        fisher_var_floor = _fisher_floor(records, fisher)
    parameters = RuleParameters(
        t_min=bounds.t_min,
        t_max=bounds.t_max,
        fixed_temperature=fixed_temperature,
        step_edges=step_edges,
        alpha_by_step=alpha_by_step,
        sigma2_by_step=sigma2_by_step,
        fisher_var_floor=fisher_var_floor,
        schedule_t_max=t_max,
        schedule_beta=beta,
        calibrated_step_edges=step_edges,
        calibrated_entropy_edges=entropy_edges,
        calibrated_temperatures=table,
    )
    return parameters, noise


def rule_temperatures(policy: TemperaturePolicy, records: PositionRecords) -> Tensor:
    """T of `policy` at every position of `records` -> float32 [N], within the policy bounds.

    `policy_temperature` (the one implementation of rule -> T), with the served-row features
    the records keep (entropy, Var_q, top probability) in place of the served logits.
    """
    features = ServedRowFeatures(
        entropy=records.served_entropy,
        var_q=records.served_var,
        top_prob=records.served_top_prob,
    )
    return policy_temperature(policy, records.step, served_features=features)


def _quality_row(
    name: str,
    *,
    kl: Tensor,
    temperatures: Tensor,
    sequence_ids: Tensor,
    kl_at_one: Tensor,
    kl_one: float,
    kl_oracle: float,
) -> QualityRow:
    kl = kl.double()
    mean = float(kl.mean())
    percentiles = torch.quantile(kl, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    gap = kl_one - kl_oracle
    gain = kl_at_one.double() - kl
    return QualityRow(
        name=name,
        mean_kl=mean,
        stderr=_cluster_stderr(kl, sequence_ids),
        gain=float(gain.mean()),
        gain_stderr=_cluster_stderr(gain, sequence_ids),
        p50=percentiles[0],
        p90=percentiles[1],
        p99=percentiles[2],
        closure=(kl_one - mean) / gap if gap > 0 else None,
        mean_temperature=float(temperatures.double().mean()),
    )


def quality_table(
    records: PositionRecords,
    policies: Sequence[TemperaturePolicy],
    min_positions: int = 100,
) -> QualityTable:
    """The quality table on `records` (held-out): T = 1, each policy's rule, and the oracle.

    Rows are named by rule value (give at most one policy per rule), with "T=1" and "oracle".

    Positions whose KL is infinite at every T (the served row masks a token the clean row
    supports) are left out. Raises `InsufficientDataError` below `min_positions` positions.
    """
    finite = torch.isfinite(records.kl_at_one)
    records = records.select(finite)
    if len(records) < min_positions:
        raise InsufficientDataError(
            f"only {len(records)} held-out positions with finite KL; the quality table needs at "
            f"least {min_positions}: use more prompts or longer completions"
        )
    ones = torch.ones(len(records))
    kl_one = float(records.kl_at_one.double().mean())
    kl_oracle = float(records.oracle_kl.double().mean())
    ids = records.sequence_id
    row = functools.partial(
        _quality_row,
        sequence_ids=ids,
        kl_at_one=records.kl_at_one,
        kl_one=kl_one,
        kl_oracle=kl_oracle,
    )
    rows = [row("T=1", kl=records.kl_at_one, temperatures=ones)]
    for policy in policies:
        t = rule_temperatures(policy, records)
        kl = interpolate_kl(records.kl_curve, records.curve_temperatures, t)
        rows.append(row(policy.rule.value, kl=kl, temperatures=t))
    rows.append(row("oracle", kl=records.oracle_kl, temperatures=records.oracle_t))
    same = records.same_top.double()
    rate = float(same.mean())
    return QualityTable(
        positions=len(records),
        sequences=int(torch.unique(ids).numel()),
        same_top_rate=rate,
        same_top_stderr=math.sqrt(rate * (1 - rate) / len(records)),
        rows=tuple(rows),
    )


def recommend_rule(quality: QualityTable, rules: Sequence[Rule] = FITTED_RULES) -> Rule:
    """The rule to serve: among `rules` (rows of `quality`, held-out), the one with the lowest
    mean KL among those whose paired gain over T = 1 is significant; `Rule.OFF` when none is.

    A rule that looks better than T = 1 only by noise is never recommended, so the served rule
    is not worse than T = 1 beyond statistical noise. (Six rules are tested at about 2 standard
    errors each; the held-out set is not used for fitting, only for this choice.)
    """
    significant = [
        row
        for row in (quality.row(rule.value) for rule in rules)
        if _is_significant(row.gain, row.gain_stderr)
    ]
    if not significant:
        return Rule.OFF
    return Rule(min(significant, key=lambda row: row.mean_kl).name)


class _RuntimeNoise(LogitsProcessor):
    """transformers logits processor adding the pair's runtime logit noise while generating."""

    def __init__(self, sigma: float, generator: torch.Generator) -> None:
        self.sigma = sigma
        self.generator = generator

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        return add_runtime_logit_noise(scores, self.sigma, self.generator)


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    seed: int,
    runtime_noise: RuntimeLogitNoiseSpec | None = None,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[ScoringSequence]:
    """Sample one completion per prompt from `model` at T = 1 (no top-k/top-p), as served.

    Sequence ids are the prompts' indices. A completion stops after the end-of-sequence token
    (which it keeps) or at `max_new_tokens`. Sampling is deterministic in `seed` and leaves the
    global RNG state as it was. `progress(done, total)` is called after each batch.
    """
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    eos_ids = model.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, list) else [] if eos_ids is None else [eos_ids])
    device = next(model.parameters()).device
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    sequences: list[ScoringSequence] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for first in range(0, len(encoded), batch_size):
            batch = encoded[first : first + batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            torch.manual_seed(seed * 1_000_003 + first)
            processors = LogitsProcessorList()
            if runtime_noise is not None and runtime_noise.sigma > 0:
                generator = torch.Generator(device=device).manual_seed(
                    runtime_noise.seed * 1_000_003 + first
                )
                processors.append(_RuntimeNoise(runtime_noise.sigma, generator))
            output = model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                logits_processor=processors,
            )
            for offset, ids in enumerate(batch):
                completion: list[int] = []
                for token in output[offset, width:].tolist():
                    completion.append(int(token))
                    if token in eos:
                        break
                sequences.append(ScoringSequence(ids + completion, len(ids), first + offset))
            if progress is not None:
                progress(min(first + batch_size, len(encoded)), len(encoded))
    return sequences


@dataclass(frozen=True)
class LoadedPair:
    """A clean and a served model sharing `tokenizer`, with their identities and the spec."""

    clean_model: PreTrainedModel
    served_model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    clean: ModelIdentity
    served: ModelIdentity
    perturbation: PerturbationSpec | None

    @property
    def runtime_noise(self) -> RuntimeLogitNoiseSpec | None:
        return self.perturbation if isinstance(self.perturbation, RuntimeLogitNoiseSpec) else None


def load_pair(
    clean_path: Path,
    *,
    served_path: Path | None = None,
    spec: PerturbationSpec | None = None,
    device: str | torch.device = "cpu",
) -> LoadedPair:
    """Load the clean checkpoint and make or load the served model.

    With `served_path` (a checkpoint, e.g. from `noisy-temp-server perturb`), its manifest's
    recorded perturbation is used, and a recorded clean identity must match `clean_path`
    (ValueError naming both otherwise). With `spec` instead, weight perturbations are applied to
    an in-memory copy of the clean model and a runtime-noise spec serves the clean weights; the
    served identity is then `ModelIdentity.perturbed(clean, spec)`, which a profile matches
    against the checkpoint `perturb` writes for the same spec.
    """
    clean_model, tokenizer = load_causal_lm(clean_path, device=device)
    clean = ModelIdentity.of_checkpoint(clean_path)
    if served_path is not None:
        served_model, _ = load_causal_lm(served_path, device=device)
        served = ModelIdentity.of_checkpoint(served_path)
        recorded_clean = served.clean_weights_sha256
        if recorded_clean is not None and recorded_clean != clean.weights_sha256:
            raise ValueError(
                f"{served_path} was made from weights sha256 {recorded_clean[:12]}..., not from "
                f"{clean_path} ({clean.describe()}); pass the clean checkpoint it was made from"
            )
        spec = served.perturbation or spec
        return LoadedPair(clean_model, served_model, tokenizer, clean, served, spec)
    if spec is None:
        raise ValueError("give a served checkpoint or a perturbation spec")
    if isinstance(spec, WeightNoiseSpec | QuantizationSpec):
        served_model = copy.deepcopy(clean_model)
        apply_perturbation(served_model, spec)
        served = ModelIdentity.perturbed(clean, spec)
        return LoadedPair(clean_model, served_model, tokenizer, clean, served, spec)
    if isinstance(spec, RuntimeLogitNoiseSpec):
        served = ModelIdentity.perturbed(clean, spec)
        return LoadedPair(clean_model, clean_model, tokenizer, clean, served, spec)
    return load_pair(spec.clean_path, served_path=spec.served_path, device=device)


@dataclass(frozen=True)
class CalibrationResult:
    """The profile, and the records it was fitted (`fit`) and measured (`held_out`) on."""

    profile: Profile
    fit: PositionRecords
    held_out: PositionRecords


def _log_progress(label: str) -> Callable[[int, int], None]:
    started = time.monotonic()

    def report(done: int, total: int) -> None:
        logger.info("%s: %d/%d (%.0f s)", label, done, total, time.monotonic() - started)

    return report


def score_pair(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
) -> PositionRecords:
    """Generate with the served model and score the pair: records for every prompt."""
    sequences = generate_completions(
        pair.served_model,
        pair.tokenizer,
        prompts,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        runtime_noise=pair.runtime_noise,
        progress=_log_progress("generating"),
    )
    scorer = PairScorer(
        pair.clean_model, pair.served_model, runtime_noise=pair.runtime_noise, device=device
    )
    report = _log_progress("scoring")
    parts = []
    for done, sequence in enumerate(sequences, start=1):
        parts.append(scorer.score_sequence(sequence))
        if done % 8 == 0 or done == len(sequences):
            report(done, len(sequences))
    return PositionRecords.concat(parts)


def calibrate_records(
    records: PositionRecords,
    pair_identity: tuple[ModelIdentity, ModelIdentity],
    perturbation: PerturbationSpec | None,
    settings: CalibrationSettings,
) -> CalibrationResult:
    """Split `records` by prompt, fit every rule on the fit part, measure on the held-out part.

    The recommended rule is `recommend_rule` on the held-out quality table. Raises
    `InsufficientDataError` when the held-out part is too small to report on.
    """
    fit_mask, held_mask = split_by_sequence(
        records.sequence_id, settings.held_out_fraction, settings.seed
    )
    fit, held_out = records.select(fit_mask), records.select(held_mask)
    parameters, noise = fit_rules(fit, settings)
    policies = [parameters.to_policy(rule) for rule in FITTED_RULES]
    quality = quality_table(held_out, policies, settings.min_quality_positions)
    recommended = recommend_rule(quality)
    profile = Profile(
        clean=pair_identity[0],
        served=pair_identity[1],
        perturbation=perturbation,
        settings=settings,
        noise_by_step=tuple(noise),
        parameters=parameters,
        recommended_rule=recommended,
        quality=quality,
    )
    return CalibrationResult(profile=profile, fit=fit, held_out=held_out)


def calibrate(
    pair: LoadedPair,
    prompts: Sequence[Prompt],
    settings: CalibrationSettings,
    *,
    device: str | torch.device = "cpu",
) -> CalibrationResult:
    """The whole pipeline of the module docstring on one pair."""
    if len(prompts) != settings.prompts:
        raise ValueError(f"settings say {settings.prompts} prompts, got {len(prompts)}")
    records = score_pair(pair, prompts, settings, device=device)
    logger.info("scored %d positions in %d sequences", len(records), len(prompts))
    return calibrate_records(records, (pair.clean, pair.served), pair.perturbation, settings)
