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

The result is columnar, `scoring.records.PositionRecords`: no logits are kept.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from noisy_temp_server.checkpoints.perturbation import (
    RuntimeLogitNoiseSpec,
    add_runtime_logit_noise,
    output_head,
)
from noisy_temp_server.correction.paired_rows import PairedRows
from noisy_temp_server.scoring.clean_backend import CleanBackend, InProcessModel
from noisy_temp_server.scoring.position_scores import (
    PositionScores,
    corrected_rows,
    scores_as_served,
)
from noisy_temp_server.scoring.records import (
    KL_CURVE_TEMPERATURES,
    PositionRecords,
    terms_at_request_temperature,
)
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.stats import PairTerms

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "LiveScores",
    "PairScorer",
    "ServedRows",
]


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


def _device_generator(seed: int, label: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{label}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


class PairScorer:
    """Scores token sequences with a clean side (a transformers model, used in process, or any
    `CleanBackend`, e.g. a remote clean server) and a served side: offline a causal LM
    (transformers) or rows the engine recorded (`scoring.engine_rows.EngineRows`, any
    `CleanBackend`), online the engine's captured rows (`score_live`; ``served_model`` may be
    None).

    Both must share the tokenizer/vocabulary; the models must have no final-logit soft-capping
    (the logits are `output_embeddings(last_hidden_state)`). They are used as given (dtype, on
    `device`); they are not modified. `runtime_noise` adds the serving-time logit noise to the
    served model's rows, from a generator seeded by (spec seed, sequence id), so scoring is
    reproducible (captured rows have the engine's own noise already).
    """

    def __init__(
        self,
        clean: PreTrainedModel | CleanBackend,
        served_model: PreTrainedModel | CleanBackend | None = None,
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
        self.served: CleanBackend | None = (
            InProcessModel(served_model, "served")
            if isinstance(served_model, torch.nn.Module)
            else served_model
        )
        sizes = (self.clean.vocab_size, None if self.served is None else self.served.vocab_size)
        if None not in sizes and sizes[0] != sizes[1]:
            raise ValueError(
                f"clean and served vocabularies differ ({sizes[0]} vs {sizes[1]}); a pair must "
                "share its tokenizer"
            )
        self.runtime_noise = runtime_noise
        self.device = torch.device(device)
        self.chunk_positions = chunk_positions
        self.curve_temperatures = curve_temperatures.float()

    @torch.no_grad()
    def logit_chunks(self, sequence: ScoringSequence) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """(step int64 [c], clean [c, V], served [c, V]) float32 rows of the completion
        positions of `sequence`, `chunk_positions` at a time, on `device`: the clean backend's
        (logits or log-probabilities, see `scoring.clean_backend`) and the served model's logits
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
        then those of softmax((z~ + b) / (T_r T*)) (`position_scores.corrected_rows`); the
        records and rows stay those of z~."""
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
        the known T* (the rows whose step has one; `bias` added first),
        and the lean records at T_r = 1 with KL curves on `grid` (empty: none)."""
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
        at_request = terms_at_request_temperature(pair, request_temperature)
        biased = None
        if bias is not None:  # softmax((z~ + b) / (T_r T*)) as served
            biased_served = corrected_rows(served, bias) / request_temperature
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
