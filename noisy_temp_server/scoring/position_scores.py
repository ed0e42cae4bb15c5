"""Per-position scores of a clean/served pair: the scoring primitives the scorer uses.

For each position of a `[B, V]` chunk of clean and served logits and the token that followed
it, at a per-position temperature T (q = softmax(served / T), p = softmax(clean)): KL(p || q),
whether the two agree on the top token, the change Δp = q(top) - p(top) of the clean model's top
token, and ln p(x) - ln q(x) of the next token x (`PositionScores`). `scores_as_served` scores
what the engine serves when the policy names a per-token bias, `corrected_rows`. The
streaming statistics over these scores are `scoring.scoreboard`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from noisy_temp_server.temperature.stats import PairTerms

__all__ = [
    "PositionScores",
    "corrected_rows",
    "position_scores",
    "scores_as_served",
    "scores_at_temperatures",
]


@dataclass(frozen=True)
class PositionScores:
    """Per-position scalars of one chunk, on the CPU: int64 `sequence_id`, `step` [B];
    float64 `kld`, `delta_p`, `log_ratio` (ln p(x) - ln q(x)) [B]; bool `same_top` [B]."""

    sequence_id: Tensor
    step: Tensor
    kld: Tensor
    same_top: Tensor
    delta_p: Tensor
    log_ratio: Tensor

    @classmethod
    def concat(cls, parts: Sequence[PositionScores]) -> PositionScores:
        """The rows of all `parts`, in order (zero rows for no parts)."""
        if not parts:
            ints, floats = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
            return cls(ints, ints, floats, torch.zeros(0, dtype=torch.bool), floats, floats)
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def select(self, rows: Tensor | slice) -> PositionScores:
        """The rows picked by a bool mask [B], an index tensor or a slice."""
        return PositionScores(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def __len__(self) -> int:
        return int(self.step.shape[0])


def scores_at_temperatures(
    pair: PairTerms,
    next_tokens: Tensor,
    temperatures: Sequence[float | Tensor],
    *,
    sequence_id: int | Tensor,
    step: Tensor,
) -> list[PositionScores]:
    """Scores of a `[B, V]` clean/served pair (its `PairTerms`: the clean log-softmax and the KL
    terms, computed once) at each of `temperatures` (each a float or `[B]`, > 0): one
    log-sum-exp of the served rows per temperature other than the float 1.0, which the terms
    already hold.

    next_tokens: int [B], the token that followed each position (the one scored for
    perplexity); step: int [B]; sequence_id: an int or int [B].
    """
    clean, served, terms = pair.clean, pair.served, pair.kl
    batch = clean.shape[0]
    if next_tokens.shape != (batch,) or step.shape != (batch,):
        raise ValueError(f"next_tokens and step must have shape [{batch}]")
    shifted = terms.served_shifted  # s = served - max(served) <= 0
    top = clean.argmax(dim=-1, keepdim=True)
    tokens = next_tokens.to(clean.device, torch.int64)[:, None]
    same_top = (top[:, 0] == served.argmax(dim=-1)).cpu()
    log_normaliser_clean = pair.clean_log_normaliser
    p_top = (clean.gather(1, top)[:, 0] - log_normaliser_clean).exp()
    log_p_token = clean.gather(1, tokens)[:, 0] - log_normaliser_clean
    ids = torch.as_tensor(sequence_id, dtype=torch.int64).expand(batch).clone()
    steps = step.detach().to("cpu", torch.int64)

    def cpu(values: Tensor) -> Tensor:
        return values.detach().to("cpu", torch.float64)

    results = []
    for temperature in temperatures:
        t = torch.as_tensor(temperature, dtype=shifted.dtype, device=shifted.device)
        u = t.expand(batch).reciprocal()
        if isinstance(temperature, float) and temperature == 1.0:
            log_normaliser = pair.served_shifted_log_normaliser()  # known from the terms
        else:
            log_normaliser = torch.logsumexp(shifted * u[:, None], dim=-1)  # [B]
        kld = terms.neg_entropy_clean - u * terms.served_mean_under_clean + log_normaliser
        log_q_top = u * shifted.gather(1, top)[:, 0] - log_normaliser
        log_q_token = u * shifted.gather(1, tokens)[:, 0] - log_normaliser
        results.append(
            PositionScores(
                sequence_id=ids,
                step=steps,
                kld=cpu(kld.clamp(min=0.0)),
                same_top=same_top,
                delta_p=cpu(log_q_top.exp() - p_top),
                log_ratio=cpu(log_p_token - log_q_token),
            )
        )
    return results


def corrected_rows(served: Tensor, bias: Tensor) -> Tensor:
    """`[B, V]` served logits z~ as the engine corrects them before the temperature: z~ + b,
    the per-token bias `bias` b (float [V]) added (a new tensor)."""
    return served + bias.to(served)


def scores_as_served(
    pair: PairTerms,
    next_tokens: Tensor,
    temperature: Tensor,
    *,
    biased: PairTerms | None,
    sequence_id: int | Tensor,
    step: Tensor,
) -> tuple[PositionScores, PositionScores]:
    """Scores at T = 1 and as served: softmax(z~ / T*) from `pair`, or, when the policy serves a
    per-token bias b, softmax((z~ + b) / T*) from `biased` (the `PairTerms`
    of the clean and the corrected served logits, `corrected_rows`); `temperature`: T* [B]. See
    `scores_at_temperatures`."""
    if biased is None:
        one, served = scores_at_temperatures(
            pair, next_tokens, [1.0, temperature], sequence_id=sequence_id, step=step
        )
        return one, served
    (one,) = scores_at_temperatures(pair, next_tokens, [1.0], sequence_id=sequence_id, step=step)
    (served,) = scores_at_temperatures(
        biased, next_tokens, [temperature], sequence_id=sequence_id, step=step
    )
    return one, served


def position_scores(
    clean: Tensor,
    served: Tensor,
    next_tokens: Tensor,
    temperature: float | Tensor,
    *,
    sequence_id: int | Tensor,
    step: Tensor,
) -> PositionScores:
    """Scores of `[B, V]` clean and served logits at one `temperature` (a float or `[B]`, > 0);
    see `scores_at_temperatures`."""
    (scores,) = scores_at_temperatures(
        PairTerms.from_logits(clean, served),
        next_tokens,
        [temperature],
        sequence_id=sequence_id,
        step=step,
    )
    return scores
