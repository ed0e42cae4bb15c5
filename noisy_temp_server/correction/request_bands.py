"""A per-token bias at request temperatures other than 1: rows as a request at temperature T_r
sees them, the best T to serve a fixed bias with there, and `BandedBias`, a bias with its own
T at each request temperature (the form a profile serves it in, `TemperaturePolicy.serving_bias`).

A request at T_r samples from softmax((z~ + b) / (T_r T)) and is judged against the clean model
at its own temperature, softmax(z / T_r) = p^(1/T_r) normalised; `at_request_temperature` takes
`PairedRows` there exactly, so every fit and evaluation of `correction.bias` applies at T_r
with the bias b / T_r.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from noisy_temp_server.correction.paired_rows import MASKED_FLOOR, LogitBias, PairedRows
from noisy_temp_server.temperature.oracle import inverse_bounds, minimise_convex
from noisy_temp_server.temperature.rules import TemperatureBounds
from noisy_temp_server.temperature.stats import KLTerms

__all__ = ["BandedBias", "at_request_temperature", "best_temperature"]


@dataclass(frozen=True)
class BandedBias:
    """A bias served with a T of its own at each request temperature T_r: `correction` (its T
    is the one at T_r = 1) and `band_temperatures` {T_r: T}, T_r = 1 among them."""

    correction: LogitBias
    band_temperatures: Mapping[float, float]

    def at(self, request_temperature: float) -> LogitBias:
        """Its correction of rows taken to `request_temperature` (`at_request_temperature`):
        softmax((z~ + b) / (T_r T)) = softmax((z~ / T_r + b / T_r) / T), T the band's
        (KeyError for a request temperature it has no band at)."""
        return LogitBias(
            self.correction.bias / request_temperature,
            self.band_temperatures[request_temperature],
        )


def at_request_temperature(rows: PairedRows, request_temperature: float) -> PairedRows:
    """`rows` as a request at temperature T_r sees them: clean softmax(z/T_r) (= p^(1/T_r),
    normalised), served z~/T_r; exact, row for row (`rows` itself at T_r = 1)."""
    if request_temperature == 1.0:
        return rows
    parts = []
    for chunk in rows.chunks():
        log_prob = torch.log_softmax(rows.clean_prob[chunk].log() / request_temperature, dim=-1)
        prob = log_prob.exp()
        masked = rows.served_shifted[chunk] <= MASKED_FLOOR  # stay at the floor, masked
        served = (rows.served_shifted[chunk] / request_temperature).masked_fill_(
            masked, MASKED_FLOOR
        )
        parts.append(
            PairedRows(
                served_shifted=served,
                clean_prob=prob,
                neg_entropy=torch.einsum("bv,bv->b", prob, log_prob.clamp(min=-1e30)).double(),
                served_mean=torch.einsum("bv,bv->b", prob, served).double(),
                clean_top=rows.clean_top[chunk],  # a temperature keeps the top token
                sequence_id=rows.sequence_id[chunk],
            )
        )
    return PairedRows.concat(parts)


def _mean_kl_terms(rows: PairedRows, shift: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean over `rows` of KL(p || softmax(u (z~ + shift))) and its first and second
    derivatives in u (`KLTerms`): float64 [1] each, for `u` [1]."""
    sums = torch.zeros(3, dtype=torch.float64, device=u.device)
    shift = shift.to(rows.served_shifted)
    for chunk in rows.chunks():
        terms = KLTerms.from_clean_prob(
            rows.clean_prob[chunk], rows.neg_entropy[chunk], rows.served_shifted[chunk] + shift
        )
        values = terms.kl_with_derivatives(u.expand(terms.neg_entropy_clean.shape[0]))
        sums += torch.stack([value.double().sum() for value in values])
    mean = sums / len(rows)
    return mean[0:1], mean[1:2], mean[2:3]


@torch.no_grad()
def best_temperature(
    rows: PairedRows, bias: Tensor, bounds: TemperatureBounds | None = None
) -> float:
    """The one T in `bounds` (default `TemperatureBounds()`) minimising the mean over `rows`
    of KL(p || softmax((z~ + bias) / T)), the bias held fixed: the mean of functions convex in
    u = 1/T (`_mean_kl_terms`), solved by `minimise_convex`."""
    if not len(rows):
        raise ValueError("cannot fit a temperature on zero rows")
    like = torch.zeros(1, dtype=torch.float64, device=rows.served_shifted.device)
    u, _ = minimise_convex(
        lambda u: _mean_kl_terms(rows, bias, u),
        *inverse_bounds(bounds or TemperatureBounds(), like),
    )
    return 1.0 / float(u)
