"""Teacher-forced scoring of a clean/served model pair, one record per completion position.

For each token sequence (prompt + completion) both models run one forward pass over the whole
sequence; the rows that produced the completion tokens (generation step s = index within the
completion) are then turned into logits and statistics a chunk of positions at a time, so peak
memory is `chunk_positions x vocab` per model however long the sequence is. The served logits
get the runtime noise of the pair, if any (`add_runtime_logit_noise`, the serving noise model).

Online (`PairScorer.score_live`) the served side is not run here: the engine captured the rows
it sampled from (`vllm_plugin.capture`, `ServedRows`), noise and rounding included, and only the
clean side is computed, teacher-forced over the same tokens. Its scoreboard scores judge each
request against what its client asked for, the clean model at the request's temperature T_r;
its records and paired rows measure the pair at T_r = 1, as the fits they feed expect.

`PositionRecords` is the columnar result: every statistic a rule needs to be fitted or
evaluated later, including a compact KL curve over `KL_CURVE_TEMPERATURES` (read off at any T by
`interpolate_kl`), so no logits are kept.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from noisy_temp_server.estimation.scoreboard import PositionScores, scores_as_served
from noisy_temp_server.files import write_atomically
from noisy_temp_server.pairs.clean_backend import CleanBackend, InProcessModel
from noisy_temp_server.pairs.perturb import (
    RuntimeLogitNoiseSpec,
    add_runtime_logit_noise,
    output_head,
)
from noisy_temp_server.temperature.bias import PairedRows
from noisy_temp_server.temperature.oracle import kl_curve_of_terms, oracle_temperature
from noisy_temp_server.temperature.stats import PairTerms

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "KL_CURVE_TEMPERATURES",
    "KLCurveInterpolant",
    "LiveScores",
    "PairScorer",
    "PositionRecords",
    "ScoringSequence",
    "ServedRows",
    "interpolate_kl",
]

# T = 2^(k/8), k = -16..16: 33 points from 1/4 to 4, 1.0 exactly at the centre.
KL_CURVE_TEMPERATURES: Tensor = torch.tensor([2.0 ** (k / 8) for k in range(-16, 17)])


@dataclass(frozen=True)
class ScoringSequence:
    """Token ids of prompt + completion; positions from `prompt_length` on are scored."""

    token_ids: Sequence[int]
    prompt_length: int
    sequence_id: int

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_length < len(self.token_ids):
            raise ValueError(
                f"sequence {self.sequence_id}: need 1 <= prompt_length < length, got "
                f"prompt_length {self.prompt_length} for {len(self.token_ids)} tokens "
                "(a completion needs at least one token)"
            )


@dataclass(frozen=True)
class ServedRows:
    """Served rows of some completion positions, as the engine sampled from them (before any
    temperature): ``steps`` int64 ``[n]`` ascending generation steps, ``rows`` float32
    ``[n, V]``, the row of ``steps[i]`` at ``i``."""

    steps: Tensor
    rows: Tensor

    def __post_init__(self) -> None:
        if self.rows.ndim != 2 or self.rows.shape[0] != self.steps.shape[0]:
            raise ValueError(
                f"served rows {tuple(self.rows.shape)} do not match {self.steps.shape[0]} steps"
            )


def _at_request_temperature(pair: PairTerms, request_temperature: float) -> PairTerms:
    """The terms of `pair` measured against softmax(z / T_r): those of (z / T_r, z~ / T_r),
    whose KL at T is KL(softmax(z / T_r) || softmax(z~ / (T_r T))); `pair` itself at T_r = 1."""
    if request_temperature == 1.0:
        return pair
    return PairTerms.from_logits(
        pair.clean / request_temperature, pair.served / request_temperature
    )


@dataclass(frozen=True)
class PositionRecords:
    """Per-position statistics of a clean/served pair; every field has N rows, on the CPU.

    sequence_id, step: int64 [N] (step = index of the token within its completion);
    tau2, sigma2, alpha, var_p_clean, kl_at_one, oracle_t, oracle_kl: float32 [N];
    same_top: bool [N]; served_entropy, served_var, served_top_prob: float32 [N] (what the
    served row shows, after runtime noise); request_temperature: float32 [N], the request
    temperature T_r the KL columns are measured at; kl_curve: float32 [N, G],
    KL(softmax(z/T_r) || softmax(z~/(T_r T))) at the T* of `curve_temperatures` (float32 [G],
    shared by all rows, not a per-row field). kl_at_one, oracle_t and oracle_kl are at T_r too;
    the noise statistics and the served-row features are those of the logits themselves.
    """

    sequence_id: Tensor
    step: Tensor
    tau2: Tensor
    sigma2: Tensor
    alpha: Tensor
    var_p_clean: Tensor
    kl_at_one: Tensor
    oracle_t: Tensor
    oracle_kl: Tensor
    same_top: Tensor
    served_entropy: Tensor
    served_var: Tensor
    served_top_prob: Tensor
    request_temperature: Tensor
    kl_curve: Tensor
    curve_temperatures: Tensor

    @classmethod
    def from_logits(
        cls,
        clean: Tensor,
        served: Tensor,
        *,
        step: Tensor,
        sequence_id: int | Tensor,
        curve_temperatures: Tensor = KL_CURVE_TEMPERATURES,
        with_oracle: bool = True,
        request_temperature: float = 1.0,
    ) -> PositionRecords:
        """Records of `[B, V]` clean and served logits (served as sampled from, noise included).

        step: int [B]; sequence_id: an int or int [B]; request_temperature: T_r > 0, the
        request temperature whose target softmax(z/T_r) the KL columns measure against.
        Statistics are computed on the logits' device and returned on the CPU. Raises
        `NonFiniteLogitsError` for NaN/+inf rows.
        `with_oracle=False` skips the per-row oracle (about a third of the cost), whose columns
        `oracle_t` and `oracle_kl` are then NaN: no fit reads them, only offline evaluation.
        """
        return cls.from_terms(
            PairTerms.from_logits(clean, served),
            step=step,
            sequence_id=sequence_id,
            curve_temperatures=curve_temperatures,
            with_oracle=with_oracle,
            request_temperature=request_temperature,
        )

    @classmethod
    def from_terms(
        cls,
        pair: PairTerms,
        *,
        step: Tensor,
        sequence_id: int | Tensor,
        curve_temperatures: Tensor = KL_CURVE_TEMPERATURES,
        with_oracle: bool = True,
        request_temperature: float = 1.0,
    ) -> PositionRecords:
        """`from_logits` of a pair whose `PairTerms` are already computed (the live scorer
        shares them with the scoreboard). An empty `curve_temperatures` skips the KL curve
        (`kl_curve` ``[N, 0]``: online, when no refitted rule reads it)."""
        if not request_temperature > 0:
            raise ValueError(f"request_temperature must be > 0, got {request_temperature!r}")
        count = pair.clean.shape[0]
        grid = curve_temperatures.to(pair.clean.device)
        stats = pair.statistics()
        features = pair.served_features
        at_request = _at_request_temperature(pair, request_temperature)
        curve = kl_curve_of_terms(at_request.kl, grid) if len(grid) else grid.new_zeros(count, 0)
        if with_oracle:
            oracle = oracle_temperature(at_request.clean, at_request.served)
            oracle_t, oracle_kl = oracle.temperature, oracle.kl
        else:
            oracle_t = oracle_kl = torch.full_like(stats.tau2, torch.nan)

        def cpu(t: Tensor) -> Tensor:
            return t.detach().to("cpu", torch.float32)

        ids = torch.as_tensor(sequence_id, dtype=torch.int64).expand(count).clone()
        return cls(
            sequence_id=ids,
            step=step.detach().to("cpu", torch.int64),
            tau2=cpu(stats.tau2),
            sigma2=cpu(stats.sigma2),
            alpha=cpu(stats.alpha),
            var_p_clean=cpu(stats.var_p_clean),
            kl_at_one=cpu(at_request.kl_at_one()),
            oracle_t=cpu(oracle_t),
            oracle_kl=cpu(oracle_kl),
            same_top=stats.same_top.cpu(),
            served_entropy=cpu(features.entropy),
            served_var=cpu(features.var_q),
            served_top_prob=cpu(features.top_prob),
            request_temperature=torch.full((count,), float(request_temperature)),
            kl_curve=cpu(curve),
            curve_temperatures=cpu(curve_temperatures),
        )

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @classmethod
    def _row_fields(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "curve_temperatures"]

    @classmethod
    def empty(cls, curve_temperatures: Tensor = KL_CURVE_TEMPERATURES) -> PositionRecords:
        """Zero rows."""
        grid = curve_temperatures.float()
        columns: dict[str, Tensor] = {}
        for name in cls._row_fields():
            if name in ("sequence_id", "step"):
                columns[name] = torch.zeros(0, dtype=torch.int64)
            elif name == "same_top":
                columns[name] = torch.zeros(0, dtype=torch.bool)
            elif name == "kl_curve":
                columns[name] = torch.zeros(0, grid.shape[0])
            else:
                columns[name] = torch.zeros(0)
        return cls(**columns, curve_temperatures=grid)

    @classmethod
    def concat(cls, parts: Sequence[PositionRecords]) -> PositionRecords:
        """Rows of all `parts` in order; they must share their curve temperatures."""
        if not parts:
            return cls.empty()
        grid = parts[0].curve_temperatures
        if any(not torch.equal(p.curve_temperatures, grid) for p in parts):
            raise ValueError("cannot concatenate records scored on different KL curve grids")
        columns = {n: torch.cat([getattr(p, n) for p in parts]) for n in cls._row_fields()}
        return cls(**columns, curve_temperatures=grid)

    def select(self, rows: Tensor) -> PositionRecords:
        """The rows picked by a bool mask [N] or an index tensor."""
        columns = {n: getattr(self, n)[rows] for n in self._row_fields()}
        return PositionRecords(**columns, curve_temperatures=self.curve_temperatures)

    def save(self, path: Path) -> None:
        """Write all columns to a safetensors file (`write_atomically`: never a partial file,
        the umask's permissions)."""
        columns = {n: getattr(self, n).contiguous() for n in self._row_fields()}
        write_atomically(path, save({**columns, "curve_temperatures": self.curve_temperatures}))

    @classmethod
    def load(cls, path: Path) -> PositionRecords:
        """Read a file written by `save`; ValueError if a column is missing or mis-sized."""
        tensors = load_file(str(path))
        missing = [n for n in [*cls._row_fields(), "curve_temperatures"] if n not in tensors]
        if missing:
            raise ValueError(f"{path} is not a records file: missing columns {missing}")
        records = cls(**{n: tensors[n] for n in [*cls._row_fields(), "curve_temperatures"]})
        if any(getattr(records, n).shape[0] != len(records) for n in cls._row_fields()):
            raise ValueError(f"{path}: columns have different numbers of rows")
        return records


@dataclass(frozen=True)
class LiveScores:
    """What the shadow scorer makes of one finished request (`PairScorer.score_live`), whose
    client asked for temperature T_r.

    records: the online estimator's records at T_r = 1, without the oracle (`oracle_t`,
    `oracle_kl` NaN); at_one: the scoreboard's per-position scores of the served model untuned,
    softmax(z~ / T_r), against the clean model at the request's temperature, softmax(z / T_r),
    every position; at_served: the same as served, softmax((z~ [+ b]) / (T_r T*)) at the T* the
    engine applied, for the positions whose T* is known; rows: paired rows (z, z~) of an evenly
    spaced share of the positions, for the online bias (None unless asked for).
    """

    records: PositionRecords
    at_one: PositionScores
    at_served: PositionScores
    rows: PairedRows | None = None


class KLCurveInterpolant:
    """Rows' KL curves as functions of log T: cubic Hermite with centred finite-difference slopes.

    kl_curves: [N, G]; curve_temperatures: [G] increasing. The slopes are computed once, so
    a fit that reads the curves at many temperatures pays for them once. Temperatures outside
    the grid are clamped to its ends, where the value is flat (derivatives 0); values below 0
    (possible between grid points where the KL is near 0) are read as 0, also flat.
    """

    def __init__(self, kl_curves: Tensor, curve_temperatures: Tensor) -> None:
        self.log_grid = curve_temperatures.double().log()
        self.curves = kl_curves.double()
        log_grid, curves = self.log_grid, self.curves
        spacing = log_grid[1:] - log_grid[:-1]  # [G-1]
        slopes = torch.empty_like(curves)  # dKL/dlogT at grid points
        slopes[:, 1:-1] = (curves[:, 2:] - curves[:, :-2]) / (log_grid[2:] - log_grid[:-2])
        slopes[:, 0] = (curves[:, 1] - curves[:, 0]) / spacing[0]
        slopes[:, -1] = (curves[:, -1] - curves[:, -2]) / spacing[-1]
        self.spacing, self.slopes = spacing, slopes

    def at(self, log_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(KL, dKL/dlogT, d2KL/dlogT2) of each row at its own log T (log_t [N]), float64 [N]."""
        log_grid = self.log_grid
        clamped = log_t.double().clamp(float(log_grid[0]), float(log_grid[-1]))
        left = torch.searchsorted(log_grid, clamped, right=True).sub(1)
        left = left.clamp(0, len(log_grid) - 2)
        rows = torch.arange(self.curves.shape[0])
        h = self.spacing[left]
        x = (clamped - log_grid[left]) / h
        y0, y1 = self.curves[rows, left], self.curves[rows, left + 1]
        m0, m1 = self.slopes[rows, left] * h, self.slopes[rows, left + 1] * h
        x2, x3 = x * x, x * x * x
        value = (
            (2 * x3 - 3 * x2 + 1) * y0
            + (x3 - 2 * x2 + x) * m0
            + (-2 * x3 + 3 * x2) * y1
            + (x3 - x2) * m1
        )
        first = (
            (6 * x2 - 6 * x) * (y0 - y1) + (3 * x2 - 4 * x + 1) * m0 + (3 * x2 - 2 * x) * m1
        ) / h
        second = ((12 * x - 6) * (y0 - y1) + (6 * x - 4) * m0 + (6 * x - 2) * m1) / (h * h)
        flat = (clamped != log_t.double()) | (value < 0)
        zero = torch.zeros_like(value)
        return (
            value.clamp(min=0.0),
            torch.where(flat, zero, first),
            torch.where(flat, zero, second),
        )


def interpolate_kl(kl_curves: Tensor, curve_temperatures: Tensor, temperatures: Tensor) -> Tensor:
    """KL of each row at its own temperature, read off its KL curve (`KLCurveInterpolant`).

    kl_curves: [N, G]; curve_temperatures: [G] increasing; temperatures: [N] (> 0) -> [N], in
    the dtype of `kl_curves`. Cubic Hermite interpolation in log T; temperatures outside the
    grid are clamped to its ends. On `KL_CURVE_TEMPERATURES` (log-T spacing ln(2)/8) the error
    against the exact KL is about 0.1-0.2% of the KL (tests bound it at 0.2% + 1e-5 absolute).
    """
    value, _, _ = KLCurveInterpolant(kl_curves, curve_temperatures).at(temperatures.double().log())
    return value.to(kl_curves.dtype)


def _device_generator(seed: int, label: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{label}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


class PairScorer:
    """Scores token sequences with a clean side (a transformers model, used in process, or any
    `CleanBackend`, e.g. a remote clean server) and a served side: a causal LM (transformers)
    offline, the engine's captured rows online (`score_live`; ``served_model`` may be None).

    Both must share the tokenizer/vocabulary; the models must have no final-logit soft-capping
    (the logits are `output_embeddings(last_hidden_state)`). They are used as given (dtype, on
    `device`); they are not modified. `runtime_noise` adds the serving-time logit noise to the
    served model's rows, from a generator seeded by (spec seed, sequence id), so scoring is
    reproducible (captured rows have the engine's own noise already).
    """

    def __init__(
        self,
        clean: PreTrainedModel | CleanBackend,
        served_model: PreTrainedModel | None = None,
        *,
        runtime_noise: RuntimeLogitNoiseSpec | None = None,
        device: str | torch.device = "cpu",
        chunk_positions: int = 64,
        curve_temperatures: Tensor = KL_CURVE_TEMPERATURES,
    ) -> None:
        if chunk_positions < 1:
            raise ValueError(f"chunk_positions must be >= 1, got {chunk_positions}")
        self.clean: CleanBackend = (
            InProcessModel(clean) if isinstance(clean, torch.nn.Module) else clean
        )
        self.served = None if served_model is None else InProcessModel(served_model, "served")
        if self.served is not None and self.clean.vocab_size not in (None, self.served.vocab_size):
            raise ValueError(
                f"clean and served vocabularies differ ({self.clean.vocab_size} vs "
                f"{self.served.vocab_size}); a pair must share its tokenizer"
            )
        self.runtime_noise = runtime_noise
        self.device = torch.device(device)
        self.chunk_positions = chunk_positions
        self.curve_temperatures = curve_temperatures.float()

    @torch.no_grad()
    def logit_chunks(self, sequence: ScoringSequence) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """(step int64 [c], clean [c, V], served [c, V]) float32 rows of the completion
        positions of `sequence`, `chunk_positions` at a time, on `device`: the clean backend's
        (logits or log-probabilities, see `pairs.clean_backend`) and the served model's logits
        with the pair's runtime noise (as sampled from, before any temperature). The row at
        step s predicts token `token_ids[prompt_length + s]`. Needs the served model."""
        if self.served is None:
            raise ValueError("this scorer has no served model (online it reads captured rows)")
        generator = None
        if self.runtime_noise is not None and self.runtime_noise.sigma > 0:
            generator = _device_generator(
                self.runtime_noise.seed, f"sequence/{sequence.sequence_id}", self.device
            )
        first = 0
        pairs = zip(
            self.clean.completion_rows(sequence, self.chunk_positions),
            self.served.completion_rows(sequence, self.chunk_positions),
            strict=True,
        )
        for clean_rows, served_rows in pairs:
            clean, served = clean_rows.to(self.device), served_rows.to(self.device)
            if generator is not None and self.runtime_noise is not None:
                served = add_runtime_logit_noise(served, self.runtime_noise.sigma, generator)
            yield torch.arange(first, first + clean.shape[0]), clean, served
            first += clean.shape[0]

    def clean_head(self) -> Tensor | None:
        """The in-process clean model's output-head weight [V, d] (detached), or None (a remote
        clean model, or one without such a head)."""
        if not isinstance(self.clean, InProcessModel):
            return None
        weight = output_head(self.clean.model)
        return None if weight is None else weight.detach()

    def clean_status(self) -> dict[str, Any]:
        """The clean backend's status (`CleanBackend.status`)."""
        return self.clean.status()

    def score_live(
        self,
        sequence: ScoringSequence,
        served_temperatures: Sequence[float],
        served: ServedRows,
        max_rows: int = 0,
        *,
        request_temperature: float,
        kl_curve: bool = True,
        bias: Tensor | None = None,
    ) -> LiveScores:
        """`LiveScores` of the positions of one finished request that have a captured served
        row (`served`; the clean side runs teacher-forced over the completion up to the last
        of them): lean records plus the scoreboard's scores at T* = 1 and at
        `served_temperatures` (the T* of generated step s at index s; positions past its end
        are scored at T* = 1 only), and the paired rows of at most `max_rows` evenly spaced of
        them, for the online bias (0: none).

        `request_temperature`: the temperature T_r the request was sampled at (> 0; greedy
        requests are never captured): the scores are KL(softmax(z / T_r) || softmax(z~ / T_r))
        untuned and KL(softmax(z / T_r) || softmax(z~ / (T_r T*))) as served (and the same-top,
        delta-p and log-ratio of those distributions), so every request is judged against
        the clean model sampled at the temperature its client asked for. The records and the
        paired rows measure the pair at T_r = 1 whatever T_r was (`LiveScores`). ValueError
        when it is not > 0. `kl_curve` False leaves the records' KL curves out (an empty
        grid), for an estimator that refits no rule that reads them. `bias`: the per-token
        bias b the request was served with (float [V]; None: none): its scores as served are
        then those of softmax((z~ + b) / (T_r T*)); the records and rows stay those of z~."""
        if not request_temperature > 0:
            raise ValueError(f"request_temperature must be > 0, got {request_temperature!r}")
        ids = list(sequence.token_ids)
        steps_wanted = served.steps.to(torch.int64)
        if not len(steps_wanted) or int(steps_wanted[-1]) >= len(ids) - sequence.prompt_length:
            raise ValueError(f"sequence {sequence.sequence_id}: captured steps beyond it")
        end = sequence.prompt_length + int(steps_wanted[-1]) + 1
        scored = ScoringSequence(ids[:end], sequence.prompt_length, sequence.sequence_id)
        records, at_one, at_served, paired = [], [], [], []
        keep_every = math.ceil(len(steps_wanted) / max(max_rows, 1))
        grid = self.curve_temperatures if kl_curve else self.curve_temperatures[:0]
        first = 0
        for clean_rows in self.clean.completion_rows(scored, self.chunk_positions):
            stop = first + clean_rows.shape[0]
            inside = (steps_wanted >= first) & (steps_wanted < stop)
            steps = steps_wanted[inside]
            if len(steps):
                clean = clean_rows[steps - first].to(self.device)
                rows = served.rows[inside].to(self.device, torch.float32)
                one, starred, record = self._live_chunk(
                    sequence,
                    steps,
                    clean,
                    rows,
                    served_temperatures,
                    request_temperature=request_temperature,
                    grid=grid,
                    bias=bias,
                )
                records.append(record)
                if max_rows:
                    kept = steps % keep_every == 0
                    paired.append(
                        PairedRows.from_logits(clean[kept], rows[kept], sequence.sequence_id)
                    )
                at_one.append(one)
                at_served.append(starred)
            first = stop
        return LiveScores(
            PositionRecords.concat(records),
            PositionScores.concat(at_one),
            PositionScores.concat(at_served),
            PairedRows.concat(paired) if paired else None,
        )

    def _live_chunk(
        self,
        sequence: ScoringSequence,
        steps: Tensor,
        clean: Tensor,
        served: Tensor,
        served_temperatures: Sequence[float],
        *,
        request_temperature: float,
        grid: Tensor,
        bias: Tensor | None,
    ) -> tuple[PositionScores, PositionScores, PositionRecords]:
        """One chunk of `score_live`: scores against softmax(z / T_r) at T* = 1 and as served at
        the known T* (the rows whose step has one; with `bias` added first), and the lean
        records at T_r = 1 with KL curves on `grid` (empty: none)."""
        pair = PairTerms.from_logits(clean, served)  # the records' (and at T_r = 1 the scores')
        record = PositionRecords.from_terms(
            pair,
            step=steps,
            sequence_id=sequence.sequence_id,
            curve_temperatures=grid.to(clean.device),
            with_oracle=False,
        )
        positions = (sequence.prompt_length + steps).tolist()
        next_tokens = torch.tensor([sequence.token_ids[p] for p in positions], device=self.device)
        known = steps < len(served_temperatures)
        t_star = torch.ones(len(steps), device=self.device)
        if known.any():
            values = torch.tensor([served_temperatures[s] for s in steps[known].tolist()])
            t_star[known.to(self.device)] = values.to(self.device)
        at_request = _at_request_temperature(pair, request_temperature)
        biased = None
        if bias is not None:  # softmax((z~ + b) / (T_r T*)) as served
            biased_served = (served + bias.to(served)) / request_temperature
            biased = PairTerms.from_logits(at_request.clean, biased_served)
        one, starred = scores_as_served(
            at_request,
            next_tokens,
            t_star,
            biased=biased,
            sequence_id=sequence.sequence_id,
            step=steps,
        )
        return one, starred.select(known), record

    def chunk_records(
        self,
        steps: Tensor,
        clean: Tensor,
        served: Tensor,
        sequence_id: int,
        *,
        request_temperature: float = 1.0,
        with_oracle: bool = True,
    ) -> PositionRecords:
        """`PositionRecords.from_logits` of one chunk of `logit_chunks`, on this scorer's KL
        curve grid."""
        return PositionRecords.from_logits(
            clean,
            served,
            step=steps,
            sequence_id=sequence_id,
            curve_temperatures=self.curve_temperatures.to(clean.device),
            request_temperature=request_temperature,
            with_oracle=with_oracle,
        )

    def score_sequence(
        self, sequence: ScoringSequence, request_temperatures: Sequence[float] = (1.0,)
    ) -> PositionRecords:
        """Records for the completion positions of one sequence (see the module docstring),
        each position once per request temperature (`PositionRecords.from_logits`), in the
        order of `request_temperatures`, chunk by chunk."""
        parts = [
            self.chunk_records(
                steps, clean, served, sequence.sequence_id, request_temperature=temperature
            )
            for steps, clean, served in self.logit_chunks(sequence)
            for temperature in request_temperatures
        ]
        return PositionRecords.concat(parts)

    def score(self, sequences: Iterable[ScoringSequence]) -> PositionRecords:
        """Records of all `sequences`, in order."""
        return PositionRecords.concat([self.score_sequence(s) for s in sequences])
