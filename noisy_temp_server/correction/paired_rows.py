"""Paired clean/served rows, the correction a bias and a temperature make of a served row,
q = softmax((z~ + b) / T), and its KL on the rows: what the bias fit (`correction.bias`) and
every measurement of a bias read.

Only what the objective needs is kept per row (`PairedRows`): the shifted served row, the clean
probabilities and three scalars, all on the rows' device; the heavy loops run over row chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from noisy_temp_server.temperature.stats import KLTerms, row_dot

__all__ = [
    "CHUNK_ELEMENTS",
    "MASKED_FLOOR",
    "BiasEvaluation",
    "LogitBias",
    "PairedRows",
    "evaluate_bias",
    "kl_objective",
]

MASKED_FLOOR = -1.0e4  # a served logit masked to -inf becomes this (exp underflows to 0)
CHUNK_ELEMENTS = 1 << 22  # rows per chunk * vocab for the [rows, V] temporaries


@dataclass(frozen=True)
class PairedRows:
    """Paired clean/served rows in the form the bias objective reads; every field has N rows.

    served_shifted: float32 [N, V], z~ - max z~ (masked tokens at -1e4, where q is 0);
    clean_prob: float32 [N, V], p = softmax(z); neg_entropy: float64 [N], E_p[log p];
    served_mean: float64 [N], E_p[s]; clean_top: int64 [N], argmax z; sequence_id: int64 [N].
    """

    served_shifted: Tensor
    clean_prob: Tensor
    neg_entropy: Tensor
    served_mean: Tensor
    clean_top: Tensor
    sequence_id: Tensor

    @classmethod
    def from_logits(cls, clean: Tensor, served: Tensor, sequence_id: int | Tensor) -> PairedRows:
        """Rows of `[B, V]` clean and served logits (validated as `KLTerms.from_logits` does).

        Rows where the served row masks a token the clean row supports are left out: their KL
        is infinite for every bias and temperature.
        """
        terms = KLTerms.from_logits(clean.float(), served.float())
        keep = torch.isfinite(terms.served_mean_under_clean)
        prob = torch.softmax(clean.float(), dim=-1)
        ids = torch.as_tensor(sequence_id, dtype=torch.int64).expand(clean.shape[0])
        return cls(
            served_shifted=terms.served_shifted[keep].clamp(min=MASKED_FLOOR),
            clean_prob=prob[keep],
            neg_entropy=terms.neg_entropy_clean[keep].double(),
            served_mean=terms.served_mean_under_clean[keep].double(),
            clean_top=clean.argmax(dim=-1)[keep],
            sequence_id=ids.to(clean.device)[keep],
        )

    def __len__(self) -> int:
        return int(self.served_shifted.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.served_shifted.shape[1])

    @classmethod
    def concat(cls, parts: Sequence[PairedRows]) -> PairedRows:
        """Rows of all `parts` in order (at least one part; same vocabulary)."""
        if not parts:
            raise ValueError("concat needs at least one part")
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def select(self, rows: Tensor) -> PairedRows:
        """The rows picked by a bool mask [N] or an index tensor."""
        rows = rows.to(self.served_shifted.device)
        return PairedRows(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def chunks(self) -> list[slice]:
        """Row slices whose [rows, V] temporaries stay near 4M elements."""
        step = max(1, CHUNK_ELEMENTS // max(1, self.vocab_size))
        return [slice(start, start + step) for start in range(0, len(self), step)]


@dataclass(frozen=True)
class LogitBias:
    """The correction served as softmax((z~ + bias) / temperature).

    bias: float32 [V] (sum 0: softmax ignores a constant); temperature: > 0.
    """

    bias: Tensor
    temperature: float

    @classmethod
    def identity(cls, vocab_size: int, device: torch.device | str = "cpu") -> LogitBias:
        """No correction: b = 0, T = 1."""
        return cls(bias=torch.zeros(vocab_size, device=device), temperature=1.0)

    def apply(self, served: Tensor) -> Tensor:
        """`[B, V]` served logits -> the corrected logits (z~ + b) / T (a new tensor)."""
        return (served + self.bias.to(served)) / self.temperature


@dataclass(frozen=True)
class BiasEvaluation:
    """A correction on rows: KL(p || corrected) float64 [N] and whether the corrected row's top
    token is the clean one, bool [N]."""

    kl: Tensor
    same_top: Tensor


def kl_objective(rows: PairedRows, u: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(mean KL, d/du, d/dc) at (u, c), without the penalty: float64 scalars and float64 [V]
    (see the module docstring)."""
    c32 = c.to(torch.float32)
    u32 = float(u)
    lse_total = torch.zeros((), dtype=torch.float64, device=c.device)
    q_mean = torch.zeros_like(c32, dtype=torch.float64)
    q_served = torch.zeros((), dtype=torch.float64, device=c.device)
    for chunk in rows.chunks():
        served = rows.served_shifted[chunk]
        scaled = torch.add(c32, served, alpha=u32)  # u * s + c
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        q = scaled.sub_(lse).exp_()
        lse_total += lse.double().sum()
        q_mean += q.sum(dim=0, dtype=torch.float64)
        q_served += row_dot(q, served).double().sum()
    count = len(rows)
    p_mean = rows.clean_prob.sum(dim=0, dtype=torch.float64) / count
    value = (
        rows.neg_entropy.mean() - u * rows.served_mean.mean() - torch.dot(p_mean, c)
    ) + lse_total / count
    grad_u = q_served / count - rows.served_mean.mean()
    grad_c = q_mean / count - p_mean
    return value, grad_u, grad_c


@torch.no_grad()
def evaluate_bias(rows: PairedRows, correction: LogitBias) -> BiasEvaluation:
    """Per-row KL(p || softmax((z~ + b) / T)) and same-top of `correction` on `rows`."""
    u = 1.0 / correction.temperature
    c = correction.bias.to(rows.served_shifted) * u
    kls, tops = [], []
    for chunk in rows.chunks():
        scaled = rows.served_shifted[chunk] * u + c
        lse = torch.logsumexp(scaled, dim=-1).double()
        tops.append(scaled.argmax(dim=-1) == rows.clean_top[chunk])
        linear = rows.clean_prob[chunk] @ c
        kl = rows.neg_entropy[chunk] - u * rows.served_mean[chunk] - linear.double() + lse
        kls.append(kl.clamp(min=0.0))
    return BiasEvaluation(kl=torch.cat(kls), same_top=torch.cat(tops))
