"""The KL scoreboard of a clean/served pair, offline: what `noisy-temp-server kld` reports.

The served model samples one completion per prompt at T = 1, as calibration does; both models
then score prompt + completion teacher-forced, and `scoring.scoreboard` accumulates llama.cpp's
statistics (mean KLD ± SE, KLD percentiles, same-top-token rate, Δp of the clean top token,
PPL ratio) for the served model at T = 1 and as served: the profile's recommended policy (or
its `rule`) with a profile, a fixed T with `t`, else T* = 1. When the profile recommends its
per-token bias b, "served" is softmax((z~ + b) / T*) with the vector from beside the profile.
With a profile whose compensation adapter is recommended, the served model samples and is
scored with the adapter, and the table has one column per layer of the stack
(`calibration.stack`), each with its share of KL(T = 1) removed and its greedy agreement with
the clean model. The continuations are the served model's own samples (llama.cpp scores a fixed
text), so the served model tends to find them likelier than the clean one does:
PPL(served)/PPL(clean) < 1 there does not mean the served model is better.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noisy_temp_server.calibration.adapter_calibration import applied_adapter
from noisy_temp_server.calibration.completions import (
    ServedRows,
    sample_served,
    served_rows_for,
)
from noisy_temp_server.calibration.profile import Profile
from noisy_temp_server.calibration.prompts import Prompt
from noisy_temp_server.calibration.served_adapter import profile_adapter
from noisy_temp_server.calibration.stack import StackReport, score_scoreboard, score_stack
from noisy_temp_server.checkpoints.loading import LoadedPair, ServedWeights, load_pair
from noisy_temp_server.checkpoints.perturbation import PerturbationSpec
from noisy_temp_server.correction.files import load_bias_file
from noisy_temp_server.scoring.engine_rows import EngineRows
from noisy_temp_server.scoring.scoreboard import ScoreboardResult
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds

__all__ = ["KldReport", "KldRequest", "format_table", "kld_report"]


@dataclass(frozen=True)
class KldRequest:
    """What to score: the pair (`clean` with `served`, or `spec` applied in memory), the
    prompts and their completions' length and seed, what is served (`profile` with its `rule`,
    a fixed `t`, else T* = 1), the greedy answers' length for a stack, the torch device, the
    cache of folder identities, how a quantized served model is loaded (`load_pair`) and where
    the served rows come from (`served_rows`: the served model's forward, the engine's rows of
    the completions it samples, `scoring.engine_rows`, not with a profile's adapter, or auto:
    `served_rows_for`)."""

    clean: Path
    prompts: Sequence[Prompt]
    served: Path | None = None
    spec: PerturbationSpec | None = None
    profile: Path | None = None
    rule: str | None = None
    t: float | None = None
    max_new_tokens: int = 64
    seed: int = 0
    greedy_tokens: int = 16
    device: str = "cpu"
    cache_dir: Path | None = None
    served_weights: ServedWeights = "auto"
    served_rows: ServedRows = "auto"


@dataclass(frozen=True)
class KldReport:
    """The scoreboard: `document` (the JSON report), the table's `columns`, the `stack` (None
    without a recommended adapter) and the positions `scored`."""

    document: dict[str, Any]
    columns: dict[str, ScoreboardResult]
    stack: StackReport | None
    scored: int

    def to_json(self) -> str:
        return json.dumps(self.document, indent=2, allow_nan=False, default=str)

    def to_text(self) -> str:
        """The pair, the llama.cpp-style table, the stack's table, and the timings."""
        document = self.document
        lines = [f"clean:  {document['clean']}\nserved: {document['served']}"]
        lines.append(format_table(self.columns))
        if self.stack is not None:
            lines.append(f"\nThe stack (adapter {document['adapter']}):\n")
            lines.append(self.stack.to_markdown())
        lines.append(
            f"scored {self.scored} tokens in {document['scoring_seconds']:.1f} s "
            f"({document['scored_tokens_per_second']:.1f} tokens/s; generation "
            f"{document['generation_seconds']:.1f} s)"
        )
        return "\n".join(lines)


def _profile_folder(request: KldRequest) -> Path:
    assert request.profile is not None  # only asked for with a profile
    return request.profile.parent


def _policy(request: KldRequest, profile: Profile | None) -> TemperaturePolicy:
    """What is served: the profile's policy (its `rule`), a fixed T, else the identity;
    ValueError for a rule without a profile or a T that is not finite and > 0."""
    if profile is not None:
        return profile.to_policy(request.rule)
    if request.rule is not None:
        raise ValueError("--rule picks a rule of --profile; give --profile too")
    if request.t is not None:
        if not (math.isfinite(request.t) and request.t > 0):
            raise ValueError(f"--t must be a finite number > 0, got {request.t}")
        bounds = TemperatureBounds(min(request.t, 1.0), max(request.t, 1.0))
        return TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=request.t, bounds=bounds)
    return TemperaturePolicy.identity()


def _row(label: str, values: Sequence[str], widths: Sequence[int]) -> str:
    return f"{label:<28}" + "".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True))


def format_table(results: dict[str, ScoreboardResult]) -> str:
    """llama.cpp-style text table: one column per entry of `results`, headed by its key, each
    column at least two spaces wider than its longest cell so titles never run together."""
    columns = list(results.values())
    widths = [max(24, len(label) + 2) for label in results]

    def each(render: Any) -> list[str]:
        return [render(r) for r in columns]

    def row(label: str, values: Sequence[str]) -> str:
        return _row(label, values, widths)

    lines = [
        row("", list(results)),
        "====== Perplexity statistics ======",
        row(
            "PPL(served)/PPL(clean)",
            each(lambda r: f"{r.ppl_ratio:.5f} ± {r.ppl_ratio * r.ln_ppl_ratio_stderr:.5f}"),
        ),
        row(
            "ln(PPL(served)/PPL(clean))",
            each(lambda r: f"{r.ln_ppl_ratio:.5f} ± {r.ln_ppl_ratio_stderr:.5f}"),
        ),
        "====== KL divergence statistics ======",
        row("Mean KLD", each(lambda r: f"{r.kld_mean:.6f} ± {r.kld_stderr:.6f}")),
    ]
    for level in columns[0].kld_percentiles:
        lines.append(row(f"{level}% KLD", each(lambda r, q=level: f"{r.kld_percentiles[q]:.6f}")))
    lines += [
        "====== Token probability statistics ======",
        row(
            "Mean Δp",
            each(lambda r: f"{100 * r.delta_p_mean:.3f} ± {100 * r.delta_p_stderr:.3f} %"),
        ),
    ]
    for level in columns[0].delta_p_percentiles:
        lines.append(
            row(f"{level}% Δp", each(lambda r, q=level: f"{100 * r.delta_p_percentiles[q]:.3f} %"))
        )
    lines += [
        row("RMS Δp", each(lambda r: f"{100 * r.delta_p_rms:.3f} %")),
        row(
            "Same top p",
            each(lambda r: f"{100 * r.same_top_rate:.3f} ± {100 * r.same_top_stderr:.3f} %"),
        ),
    ]
    first = columns[0]
    lines.append(
        f"{first.positions} positions in {first.sequences} sequences "
        f"({first.infinite_positions} with infinite KL left out); SE cluster-robust by sequence"
        + ("" if first.exact_percentiles else "; percentiles from a uniform sample")
    )
    return "\n".join(lines)


def _score(
    request: KldRequest,
    pair: LoadedPair,
    sequences: list[ScoringSequence],
    profile: Profile | None,
    policy: TemperaturePolicy,
    *,
    with_adapter: bool,
    engine_rows: EngineRows | None,
) -> tuple[
    dict[str, ScoreboardResult], dict[str, ScoreboardResult], float | None, StackReport | None
]:
    """Score `sequences`: each layer of the stack when the profile serves an adapter, else T = 1
    against `policy` as served (the served rows from `engine_rows` when given). Returns (the
    table's columns by title, every statistic by label, the mean T* served or None for a
    stack, the stack or None)."""
    if profile is not None and with_adapter:
        stack = score_stack(
            pair,
            sequences,
            profile,
            _profile_folder(request),
            served_policy=policy,
            greedy_tokens=request.greedy_tokens,
            device=request.device,
        )
        results = {layer.label: layer.result for layer in stack.layers}
        return results, results, None, stack
    bias = None if policy.bias is None else load_bias_file(_profile_folder(request), policy.bias)
    board = score_scoreboard(
        pair, sequences, policy, bias=bias, device=request.device, engine_rows=engine_rows
    )
    by_label = board.result()
    mean_t_star = board.mean_temperature()
    with_bias = "" if policy.bias is None else " + bias"
    label = f"T* ({policy.rule.value}{with_bias}, mean {mean_t_star:.3f})"
    return {"T=1": by_label["T=1"], label: by_label["T*"]}, by_label, mean_t_star, None


def kld_report(request: KldRequest) -> KldReport:
    """Sample, score and report the pair `request` names (module docstring). Raises ValueError
    for bad input (a bad folder or pair, a profile of another pair, a bad rule or T) and
    `CorruptCheckpointError` for a damaged checkpoint."""
    pair = load_pair(
        request.clean, served_path=request.served, spec=request.spec, device=request.device,
        cache_dir=request.cache_dir, served_weights=request.served_weights,
    )  # fmt: skip
    profile = (
        None
        if request.profile is None
        else Profile.load_for_pair(request.profile, pair.clean, pair.served)
    )
    policy = _policy(request, profile)
    adapter = None if profile is None else profile_adapter(profile, _profile_folder(request))
    served_rows = served_rows_for(pair, request.served_rows, with_adapter=adapter is not None)
    if adapter is not None and served_rows == "engine":
        raise ValueError(
            "the engine's rows are the served model's without an adapter, and this profile "
            "serves one: score it with --served-rows model"
        )
    started = time.monotonic()
    with applied_adapter(pair.served_model, adapter):  # sampled as served
        sequences, engine_rows = sample_served(
            pair,
            request.prompts,
            served_rows,
            max_new_tokens=request.max_new_tokens,
            seed=request.seed,
        )
    generated = time.monotonic()
    columns, statistics, mean_t_star, stack = _score(
        request,
        pair,
        sequences,
        profile,
        policy,
        with_adapter=adapter is not None,
        engine_rows=engine_rows,
    )
    scoring_seconds = time.monotonic() - generated
    first = next(iter(columns.values()))
    scored = first.positions + first.infinite_positions
    document = {
        "clean": pair.clean.describe(),
        "served": pair.served.describe(),
        "policy": json.loads(policy.to_json()),
        "adapter": None if profile is None or profile.adapter is None else profile.adapter.sha256,
        "served_rows": served_rows,
        "mean_t_star": mean_t_star,
        "generation_seconds": generated - started,
        "scoring_seconds": scoring_seconds,
        "scored_tokens_per_second": scored / scoring_seconds if scoring_seconds > 0 else None,
        "statistics": {label: result.to_dict() for label, result in statistics.items()},
        "stack": None if stack is None else [layer.to_dict() for layer in stack.layers],
    }
    return KldReport(document, columns, stack, scored)
