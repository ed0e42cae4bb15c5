"""Per-row statistics of clean and served logits, and the KL that a temperature can fix.

Every function takes logits of shape ``[batch, vocab]`` (any floating dtype, any device) and
returns ``[batch]`` tensors on the same device. Arithmetic runs in float32 (float64 for float64
input), so bf16/fp16 logits give the float32 answer. Inputs are never modified.

Conventions:

* ``-inf`` marks a masked token: it has probability 0 and is left out of every statistic. A row
  that is entirely ``-inf`` has no distribution and is an error, as are NaN and ``+inf``
  (:class:`NonFiniteLogitsError`).
* Uniform variances (``tau2``, ``sigma2``) are population variances (divide by the number of
  tokens counted), over the unmasked tokens.
* A token whose clean probability is 0 in the compute dtype (masked, or below about 1e-45)
  contributes nothing to ``KL(p || q)``. A token masked in the served row (``-inf``) that the
  clean row gives positive probability makes the KL ``+inf`` at every temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "KLTerms",
    "NonFiniteLogitsError",
    "PairStatistics",
    "PairTerms",
    "RowScratch",
    "ServedRowFeatures",
    "check_logits",
    "compute_dtype",
    "pair_statistics",
    "row_dot",
    "served_row_features",
    "stable_log_softmax",
]

# Below this, exp() is exactly 0 in float32 and float64, and its square is still finite: shifted
# logits are floored here so that 0 * (-inf) terms become 0 * finite = 0, not NaN.
_SHIFTED_LOGIT_FLOOR = -1.0e4
_ROWS_SHOWN_IN_ERRORS = 8


class NonFiniteLogitsError(ValueError):
    """Logits contain NaN or +inf, or a row where every token is masked (-inf)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of ``dtype`` logits are computed in: float64 stays, all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _format_rows(rows: Tensor) -> str:
    indices = rows.nonzero().flatten().tolist()
    shown = ", ".join(str(i) for i in indices[:_ROWS_SHOWN_IN_ERRORS])
    more = f", ... ({len(indices)} rows)" if len(indices) > _ROWS_SHOWN_IN_ERRORS else ""
    return f"[{shown}{more}]"


def check_logits(logits: Tensor, *, name: str = "logits") -> None:
    """Raise unless ``logits`` is a ``[batch, vocab]`` floating tensor usable as logits.

    Allowed: finite values and ``-inf`` (masked tokens). Raises :class:`NonFiniteLogitsError`
    naming the offending rows for NaN, ``+inf``, or a row that is entirely ``-inf``; raises
    ``ValueError`` for a wrong shape or dtype. Costs one ``[batch]`` max reduction (and one
    device sync to read its verdict).
    """
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name} must have shape [batch, vocab] with vocab >= 1, got {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {logits.dtype}")
    # amax propagates NaN, is +inf if any entry is +inf, and -inf only if the row is all -inf.
    row_max = logits.amax(dim=-1)
    bad = ~torch.isfinite(row_max)
    if not bool(bad.any()):
        return
    non_finite = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    all_masked = bad & ~non_finite
    problems = []
    if bool(non_finite.any()):
        problems.append(f"rows {_format_rows(non_finite)} contain NaN or +inf")
    if bool(all_masked.any()):
        problems.append(f"rows {_format_rows(all_masked)} are entirely -inf (every token masked)")
    raise NonFiniteLogitsError(
        f"{name}: {'; '.join(problems)}. Logits must be finite, with -inf only for masked "
        "tokens and at least one unmasked token per row."
    )


def _check_pair(clean: Tensor, served: Tensor) -> None:
    check_logits(clean, name="clean logits")
    check_logits(served, name="served logits")
    if clean.shape != served.shape:
        raise ValueError(
            f"clean and served logits must have the same shape, got {tuple(clean.shape)} "
            f"and {tuple(served.shape)}"
        )
    if clean.device != served.device:
        raise ValueError(
            f"clean and served logits must be on the same device, got {clean.device} "
            f"and {served.device}"
        )


def stable_log_softmax(logits: Tensor) -> Tensor:
    """``log_softmax`` over the last dim, computed in :func:`compute_dtype` (max-shifted).

    Returns a new tensor; masked tokens (-inf) get -inf. The input is not modified.
    """
    return torch.log_softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype))


def row_dot(a: Tensor, b: Tensor, *, product: Tensor | None = None) -> Tensor:
    """Row-wise dot product of two ``[B, V]`` tensors -> ``[B]``: one vectorised multiply into
    ``product`` (a ``[B, V]`` buffer; None: a new one) and one sum (on a CPU, ``einsum``'s
    batched matrix product is several times slower for B > 1)."""
    return torch.mul(a, b, out=product).sum(dim=-1)


class RowScratch:
    """Reusable ``[B, V]`` buffers for statistics computed at every decode step
    (`served_row_features`): on a CPU, fresh buffers that large can be new pages each step,
    faulted in on top of the arithmetic. Each buffer grows to the most rows asked
    for and is never shrunk (the memory the temporaries would peak at anyway). One per caller:
    not thread-safe, and a buffer is overwritten by the next `take`."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []

    def take(self, count: int, like: Tensor, dtype: torch.dtype) -> list[Tensor]:
        """``count`` distinct contiguous buffers of ``like``'s shape (2-D) and device, in
        ``dtype``; their contents are undefined."""
        rows, width = like.shape
        for index in range(count):
            held = self._buffers[index] if index < len(self._buffers) else None
            if (
                held is None
                or held.shape[0] < rows
                or held.shape[1] != width
                or held.dtype != dtype
                or held.device != like.device
            ):
                fresh = torch.empty((rows, width), dtype=dtype, device=like.device)
                self._buffers[index : index + 1] = [fresh]
        return [buffer[:rows] for buffer in self._buffers[:count]]


def _softmax_moments(
    logits: Tensor, *, scratch: RowScratch | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(weights [B, V], total [B], neg_entropy [B], variance [B])`` of ``softmax(logits)``.

    With ``c = logits - max`` (<= 0): ``weights = exp(c)`` (unnormalised; the probabilities are
    ``weights / total``), ``total = sum(weights) >= 1`` (so the top probability is
    ``1 / total``), ``-H = E_q[c] - log(total)`` (a sum of two non-positive terms) and
    ``variance = E_q[(c - E_q[c])^2]`` (two-pass: the softmax-weighted variance of the logits).
    One exp per element and three ``[B, V]`` temporaries: ``c`` (reused in place), ``weights``
    and the row products; taken from ``scratch`` when given (``weights`` is then overwritten by
    the next call with that scratch).
    """
    dtype = compute_dtype(logits.dtype)
    buffers = [None] * 3 if scratch is None else scratch.take(3, logits, dtype)
    peak = logits.amax(dim=-1, keepdim=True).to(dtype)
    shifted = torch.sub(logits.to(dtype), peak, out=buffers[0])  # [B, V]
    weights = torch.exp(shifted, out=buffers[1])  # [B, V]
    total = weights.sum(dim=-1)
    shifted.clamp_(min=_SHIFTED_LOGIT_FLOOR)  # where exp() is 0, so -inf * 0 terms become 0
    mean = row_dot(weights, shifted, product=buffers[2]) / total  # E_q[c] <= 0
    neg_entropy = (mean - total.log()).clamp(max=0.0)
    shifted.sub_(mean.unsqueeze(-1)).square_()
    variance = row_dot(weights, shifted, product=buffers[2]) / total
    return weights, total, neg_entropy, variance


def _uniform_variance(values: Tensor, counted: Tensor | None) -> Tensor:
    """Population variance of ``values`` over the ``counted`` entries of each row (NaN if none);
    ``counted=None`` counts every entry (no masks to build)."""
    if counted is None:
        return (values - values.mean(dim=-1, keepdim=True)).square_().mean(dim=-1)
    count = counted.sum(dim=-1).to(values.dtype)
    filled = torch.where(counted, values, 0.0)
    mean = filled.sum(dim=-1) / count
    deviation = torch.where(counted, values - mean.unsqueeze(-1), 0.0)
    return deviation.square().sum(dim=-1) / count


def _has_masked(logits: Tensor) -> bool:
    """Whether validated logits (no NaN, no +inf) mask any token (-inf): one min reduction."""
    return logits.numel() > 0 and bool(torch.isneginf(logits.amin()))


@dataclass(frozen=True)
class ServedRowFeatures:
    """What the served row alone shows; each field is ``[batch]`` in the compute dtype.

    Attributes:
        entropy: H(q) in nats, q = softmax(served).
        var_q: Var_q(served), the softmax-weighted variance of the served logits (all NaN when
            built with ``need_variance=False``).
        top_prob: max_i q_i.
    """

    entropy: Tensor
    var_q: Tensor
    top_prob: Tensor


def served_row_features(
    served: Tensor,
    *,
    validate: bool = True,
    need_variance: bool = True,
    scratch: RowScratch | None = None,
) -> ServedRowFeatures:
    """Entropy, softmax-weighted variance and top probability of each served row.

    Built for the per-step logits processor: one exp per element. With ``need_variance=False``
    (``var_q`` all NaN) one fused softmax and one product over the row (`_softmax_entropy`);
    otherwise the moments' passes and three ``[B, V]`` temporaries in the compute dtype, taken
    from ``scratch`` when given (the processor's, reused every step). With ``validate=False`` it
    skips :func:`check_logits` (and its device sync); invalid rows then give NaN features
    instead of raising.
    """
    if validate:
        check_logits(served, name="served logits")
    if not need_variance:
        entropy, top_prob = _softmax_entropy(served)
        return ServedRowFeatures(entropy, torch.full_like(entropy, torch.nan), top_prob)
    _, total, neg_entropy, var_q = _softmax_moments(served, scratch=scratch)
    return ServedRowFeatures(entropy=-neg_entropy, var_q=var_q, top_prob=total.reciprocal())


def _softmax_entropy(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(entropy [B], top probability [B])`` of ``softmax(logits)``, for the per-step path:
    one fused softmax and one in-place product over ``[B, V]`` (one temporary), half the passes
    of `_softmax_moments`. ``H = logsumexp - E_q[logits]``, where ``logsumexp = max - log(top
    probability)``; masked tokens (-inf, probability 0) are left out of ``E_q``. A row with NaN
    or +inf logits, or every token masked, gets NaN."""
    values = logits.to(compute_dtype(logits.dtype))
    prob = torch.softmax(values, dim=-1)  # [B, V]
    top_prob = prob.amax(dim=-1)
    log_total = values.amax(dim=-1) - top_prob.log()
    mean = prob.mul_(values).nansum(dim=-1)  # 0 * -inf is NaN: the masked tokens' terms
    return (log_total - mean).clamp(min=0.0), top_prob


@dataclass(frozen=True)
class KLTerms:
    """``KL(p || softmax(u * served))`` as a function of the inverse temperature ``u = 1/T``.

    With ``s = served - max(served)`` (shift-invariant) and ``m = E_p[s]``::

        KL(u)   = E_p[log p] - u * m + logsumexp(u * s)
        KL'(u)  = E_{q_u}[s] - m
        KL''(u) = Var_{q_u}(s) >= 0          (convex in u)

    Build with :meth:`from_logits`. ``m`` is ``-inf`` (so KL is ``+inf`` at every ``u``) for rows
    where the served row masks a token the clean row gives positive probability.

    Attributes:
        neg_entropy_clean: ``[B]`` E_p[log p].
        served_mean_under_clean: ``[B]`` m = E_p[s].
        served_shifted: ``[B, V]`` s, with -inf at masked tokens.
        served_filled: ``[B, V]`` s with -inf replaced by 0 (for products with q, which is 0 there).
    """

    neg_entropy_clean: Tensor
    served_mean_under_clean: Tensor
    served_shifted: Tensor
    served_filled: Tensor

    @classmethod
    def from_logits(cls, clean: Tensor, served: Tensor) -> KLTerms:
        """Validate a ``[B, V]`` pair (same shape and device) and precompute its KL terms."""
        _check_pair(clean, served)
        weights, total, neg_entropy, _ = _softmax_moments(clean)
        return cls.from_clean_prob(weights.div_(total.unsqueeze(-1)), neg_entropy, served)

    @classmethod
    def from_clean_prob(cls, prob: Tensor, neg_entropy: Tensor, served: Tensor) -> KLTerms:
        """From the clean probabilities ``[B, V]`` and E_p[log p] ``[B]`` already at hand (the
        served row ``[B, V]`` is shifted here; not validated: `from_logits` validates)."""
        served = served.to(prob.dtype)
        shifted = served - served.amax(dim=-1, keepdim=True)
        if not _has_masked(shifted):
            return cls(neg_entropy, row_dot(prob, shifted), shifted, shifted)
        filled = torch.nan_to_num(shifted, neginf=0.0)
        supported = prob > 0
        support_masked = (supported & torch.isneginf(shifted)).any(dim=-1)
        mean = torch.where(support_masked, float("-inf"), row_dot(prob, filled))
        return cls(neg_entropy, mean, shifted, filled)

    def kl(self, inverse_temperature: Tensor) -> Tensor:
        """KL at ``u``: ``[B]`` -> ``[B]``, or ``[B, G]`` / ``[1, G]`` -> ``[B, G]``.

        ``u`` must be > 0. Memory: one ``[B, G, V]`` temporary for 2-D ``u`` (chunk G yourself,
        or use :func:`noisy_temp_server.temperature.oracle.kl_curve`). Clamped at 0 so rounding
        never reports a negative divergence.
        """
        u = inverse_temperature.to(self.served_shifted.dtype)
        if u.dim() == 1:
            return self.kl(u.unsqueeze(-1)).squeeze(-1)
        scaled = self.served_shifted.unsqueeze(1) * u.unsqueeze(-1)  # [B, G, V]
        log_normaliser = torch.logsumexp(scaled, dim=-1)  # [B, G]
        kl = (
            self.neg_entropy_clean.unsqueeze(-1)
            - u * self.served_mean_under_clean.unsqueeze(-1)
            + log_normaliser
        )
        return kl.clamp(min=0.0)

    def kl_with_derivatives(self, inverse_temperature: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(KL(u), KL'(u), KL''(u))`` for one ``u > 0`` per row (``[B]`` each)."""
        u = inverse_temperature.to(self.served_shifted.dtype).unsqueeze(-1)  # [B, 1]
        scaled = self.served_shifted * u  # [B, V]
        log_normaliser = torch.logsumexp(scaled, dim=-1)  # [B]
        q = scaled.sub_(log_normaliser.unsqueeze(-1)).exp_()  # softmax(u * s), in place
        mean_q = row_dot(q, self.served_filled)
        var_q = row_dot(q, (self.served_filled - mean_q.unsqueeze(-1)).square())
        kl = self.neg_entropy_clean - u.squeeze(-1) * self.served_mean_under_clean + log_normaliser
        return kl.clamp(min=0.0), mean_q - self.served_mean_under_clean, var_q


@dataclass(frozen=True)
class PairStatistics:
    """Statistics of a clean/served pair of rows; every field is ``[batch]``.

    Float fields are float32 (float64 for float64 input).

    Attributes:
        tau2: Var(z), uniform over the clean row's unmasked tokens.
        sigma2: Var(z~ - z), uniform over tokens finite in both rows; NaN if there is none.
        alpha: sigma2 / tau2. When tau2 == 0 (a flat clean row): 0 if sigma2 == 0, else +inf
            (every rule then saturates at its upper bound, which is also where the oracle goes:
            the flattest q is closest to a uniform p). NaN where sigma2 is NaN.
        var_p_clean: Var_p(z), the softmax-weighted variance of the clean logits.
        entropy_clean: H(p) in nats.
        kl_at_one: KL(p || softmax(z~)); +inf if the served row masks a token p supports.
        same_top: argmax z == argmax z~ (bool; ties go to the lowest index).
    """

    tau2: Tensor
    sigma2: Tensor
    alpha: Tensor
    var_p_clean: Tensor
    entropy_clean: Tensor
    kl_at_one: Tensor
    same_top: Tensor


@dataclass(frozen=True)
class PairTerms:
    """The softmax work of a validated ``[B, V]`` clean/served pair, done once and shared by every
    per-position statistic of it: the pair statistics (:meth:`statistics`), the KL curve
    (:func:`noisy_temp_server.temperature.oracle.kl_curve_of_terms`) and the scoreboard's scores
    (:func:`noisy_temp_server.scoring.position_scores.scores_at_temperatures`). Build it with
    :meth:`from_logits`: one softmax pass over each row (an exp per element, two weighted sums).

    Attributes:
        clean, served: ``[B, V]`` the logits in the compute dtype.
        kl: the :class:`KLTerms` of the pair (``KL(p || softmax(u * served))`` at any ``u``).
        clean_log_normaliser: ``[B]`` ``logsumexp(clean)``, so ``log p_i = clean_i - it``.
        var_p_clean: ``[B]`` Var_p(clean), the softmax-weighted variance of the clean logits.
        served_features: what the served row alone shows (:class:`ServedRowFeatures`).
    """

    clean: Tensor
    served: Tensor
    kl: KLTerms
    clean_log_normaliser: Tensor
    var_p_clean: Tensor
    served_features: ServedRowFeatures

    @classmethod
    def from_logits(cls, clean: Tensor, served: Tensor) -> PairTerms:
        """Validate a ``[B, V]`` pair (as :func:`pair_statistics`) and compute its terms.

        Raises :class:`NonFiniteLogitsError` for NaN/+inf/all-masked rows, ``ValueError`` for
        mismatched shapes or devices.
        """
        _check_pair(clean, served)
        dtype = compute_dtype(clean.dtype)
        z, z_served = clean.to(dtype), served.to(dtype)
        weights, total, neg_entropy, var_p = _softmax_moments(z)
        log_normaliser = total.log() + z.amax(dim=-1)
        kl = KLTerms.from_clean_prob(weights.div_(total.unsqueeze(-1)), neg_entropy, z_served)
        features = served_row_features(z_served, validate=False)  # validated above
        return cls(z, z_served, kl, log_normaliser, var_p, features)

    def served_shifted_log_normaliser(self) -> Tensor:
        """``[B]`` ``logsumexp(s)`` of the max-shifted served row ``s`` (>= 0), from the served
        row's top probability (no further pass over the row)."""
        return -self.served_features.top_prob.log()  # top_prob = 1 / sum(exp(s))

    def kl_at_one(self) -> Tensor:
        """``[B]`` KL(p || softmax(served)) (no further pass over the rows); +inf where the
        served row masks a token p supports."""
        kl = (
            self.kl.neg_entropy_clean
            - self.kl.served_mean_under_clean
            + self.served_shifted_log_normaliser()
        )
        return kl.clamp(min=0.0)

    def statistics(self) -> PairStatistics:
        """The pair's :class:`PairStatistics`."""
        z, z_served = self.clean, self.served
        if _has_masked(z) or _has_masked(z_served):
            clean_finite = torch.isfinite(z)
            tau2 = _uniform_variance(z, clean_finite)
            sigma2 = _uniform_variance(z_served - z, clean_finite & torch.isfinite(z_served))
        else:
            tau2, sigma2 = _uniform_variance(z, None), _uniform_variance(z_served - z, None)
        return PairStatistics(
            tau2=tau2,
            sigma2=sigma2,
            alpha=torch.where(sigma2 == 0, 0.0, sigma2 / tau2),
            var_p_clean=self.var_p_clean,
            entropy_clean=-self.kl.neg_entropy_clean,
            kl_at_one=self.kl_at_one(),
            same_top=z.argmax(dim=-1) == z_served.argmax(dim=-1),
        )


def pair_statistics(clean: Tensor, served: Tensor) -> PairStatistics:
    """Per-row :class:`PairStatistics` of ``[B, V]`` clean and served logits
    (``PairTerms.from_logits(clean, served).statistics()``).

    Raises :class:`NonFiniteLogitsError` for NaN/+inf/all-masked rows, ``ValueError`` for
    mismatched shapes or devices.
    """
    return PairTerms.from_logits(clean, served).statistics()
