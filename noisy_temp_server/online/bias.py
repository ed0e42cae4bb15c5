"""The served per-token bias, refined online from shadow-scored rows, published only when it
is significantly better on rows it never trained on.

`OnlineBias` receives the paired rows of each shadow-scored choice (a bounded, evenly spaced
share of its positions). The requests whose sequence id is a multiple of `holdout_every`
(one in `holdout_every`: the shadow scorer's ids are hashes of the request id) go to a held-out
reservoir (the most recent `holdout_rows` rows, whole choices); the others update a
`StreamingBias` (O(V) state, the same objective and penalty as calibration's fit; with the bias
served in request-temperature bands, its bands too). `candidate` compares the streaming fit
with the published correction on the reservoir, position by position: it is offered for
publication only when its paired KL gain exceeds two standard errors clustered by request
(`significance.is_significant`) on at least `min_holdout_requests` requests, and removes at
least `min_relative_gain` of the published correction's held-out KL and 1e-6 nats (a new
version is a new vector to move; numerical noise must not publish one); with bands, at every
other request temperature too, the reservoir taken to it, it must not be significantly worse
than the published bias with its band there, nor than the calibrated one
(`significance.is_not_worse`). Memory: the streaming state plus the reservoir, both bounded;
nothing grows with the traffic.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence

from torch import Tensor

from noisy_temp_server.calibration.profile import BiasSummary
from noisy_temp_server.calibration.significance import (
    is_not_worse,
    is_significant,
)
from noisy_temp_server.correction.files import check_bias_vocabulary
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows, evaluate_bias
from noisy_temp_server.correction.request_bands import BandedBias, at_request_temperature
from noisy_temp_server.correction.streaming_bias import StreamingBias
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.temperature.rules import TemperatureBounds

__all__ = ["OnlineBias"]

_MIN_GAIN = 1e-6  # nats per position: below, a held-out gain is numerical noise


class OnlineBias:
    """See the module docstring. ``published``: the correction served now (the start of the
    streaming fit), with ``band_temperatures``, its T at other request temperatures when it is
    served in bands; ``penalty``: the per-token L2 penalty it was fitted with; ``basis`` and
    ``head_penalty``: the clean output head and the penalty of the part in its span (both or
    neither: the streaming fit then steps in that span too); ``prior_rows``: the rows the
    published correction was fitted on (`StreamingBias`). A T_r = 1 entry of
    ``band_temperatures`` is the correction's own T, whatever it says."""

    def __init__(
        self,
        published: LogitBias,
        penalty: float,
        *,
        band_temperatures: Mapping[float, float] | None = None,
        basis: Tensor | None = None,
        head_penalty: float | None = None,
        prior_rows: int = 0,
        bounds: TemperatureBounds | None = None,
        holdout_every: int = 4,
        holdout_rows: int = 256,
        min_holdout_requests: int = 8,
        min_relative_gain: float = 1e-3,
    ) -> None:
        if holdout_every < 2 or holdout_rows < 1 or min_holdout_requests < 2:
            raise ValueError(
                "need holdout_every >= 2, holdout_rows >= 1 and min_holdout_requests >= 2"
            )
        self.fit = StreamingBias(
            published,
            penalty,
            basis=basis,
            head_penalty=head_penalty,
            bounds=bounds,
            prior_rows=prior_rows,
            band_temperatures=band_temperatures,
        )
        bands = {**(band_temperatures or {}), 1.0: published.temperature}
        self.published = BandedBias(published, dict(sorted(bands.items())))
        self._calibrated = self.published  # the bands never fall behind it, version by version
        calibrated_bias = published.bias.detach()
        self._calibrated_centred = calibrated_bias - calibrated_bias.mean()
        self._holdout_every = holdout_every
        self._holdout_rows = holdout_rows
        self._min_requests = min_holdout_requests
        self._min_relative_gain = min_relative_gain
        self._holdout: deque[PairedRows] = deque()
        self._held_ids: Counter[int] = Counter()  # read by `status` without the fit's lock
        self._held_rows = 0
        self._change_from_calibrated = 0.0  # read by `status` without the fit's lock
        self.requests = 0

    @classmethod
    def refining(
        cls,
        published: LogitBias,
        summary: BiasSummary,
        *,
        request_temperatures: Sequence[float],
        head_basis: Tensor | None = None,
        fallback_prior_rows: int = 0,
        bounds: TemperatureBounds | None = None,
    ) -> OnlineBias:
        """The online refinement of the calibrated bias `summary` describes, served as
        `published`: its per-token penalty; its bands, when it has them, at
        `request_temperatures` (the profile's); with a `head_basis` of the bias's vocabulary
        and a head-span part, steps in that span too (at its penalty); as prior rows the rows
        it was fitted on (`fallback_prior_rows` when the profile predates recording them).
        ValueError when the summary has no per-token penalty (a T-only fit: no bias to
        refine)."""
        if summary.penalty is None:
            raise ValueError("the calibrated fit is T only: there is no bias to refine")
        fits = head_basis is not None and head_basis.shape[0] == published.bias.numel()
        head_penalty = summary.head_penalty if fits else None
        bands = (
            None
            if summary.band_temperatures is None
            else summary.served_temperatures(request_temperatures)
        )
        return cls(
            published,
            summary.penalty,
            band_temperatures=bands,
            basis=head_basis if head_penalty is not None else None,
            head_penalty=head_penalty,
            prior_rows=summary.fitted_rows or fallback_prior_rows,
            bounds=bounds,
        )

    def add(self, rows: PairedRows) -> None:
        """One choice's rows (one sequence id: its request's; the served side unmapped, z~, and
        without masked tokens): to the reservoir when the id is a
        multiple of `holdout_every`, else a step of the streaming fit. All choices of a request
        share its id, so they fall on the same side: a held-out row never has a twin (the n
        choices' identical first rows) that the fit trained on. ValueError when their
        vocabulary is not the published bias's (a correction fitted for
        another model must not be refined, let alone published, for this one).
        """
        if not len(rows):
            return
        where = "the shadow-scored model"
        check_bias_vocabulary(self.published.correction.bias, rows.vocab_size, where)
        self.requests += 1
        if int(rows.sequence_id[0]) % self._holdout_every:
            self.fit.update(rows)
            self._change_from_calibrated = self._largest_change_from_calibrated()
            return
        self._holdout.append(rows)
        self._held_ids[int(rows.sequence_id[0])] += 1
        self._held_rows += len(rows)
        while self._held_rows - len(self._holdout[0]) >= self._holdout_rows:
            dropped = self._holdout.popleft()
            self._held_rows -= len(dropped)
            self._held_ids -= Counter([int(dropped.sequence_id[0])])

    def candidate(self) -> BandedBias | None:
        """The streaming fit, when its held-out gain over the published correction is
        significant and, with bands, it is not significantly worse at any other request
        temperature than the published correction nor than the calibrated one (a small step
        back each version must not add up); else None."""
        if self._held_requests() < self._min_requests or not self.fit.rows_seen:
            return None
        rows = PairedRows.concat(list(self._holdout))
        proposed = self.fit.banded
        published_kl = evaluate_bias(rows, self.published.correction).kl
        gain = published_kl - evaluate_bias(rows, proposed.correction).kl
        mean_gain = float(gain.mean())
        if mean_gain < max(self._min_relative_gain * float(published_kl.mean()), _MIN_GAIN):
            return None
        ids = rows.sequence_id.cpu()
        if not is_significant(mean_gain, cluster_stderr(gain, ids)):
            return None
        for request_temperature in self.published.band_temperatures:
            if request_temperature == 1.0:
                continue
            at_t_r = at_request_temperature(rows, request_temperature)
            proposed_kl = evaluate_bias(at_t_r, proposed.at(request_temperature)).kl
            references = {id(r): r for r in (self.published, self._calibrated)}  # once each
            for reference in references.values():
                band_gain = evaluate_bias(at_t_r, reference.at(request_temperature)).kl
                band_gain -= proposed_kl
                if not is_not_worse(float(band_gain.mean()), cluster_stderr(band_gain, ids)):
                    return None
        return proposed

    def _largest_change_from_calibrated(self) -> float:
        """max_v |b_v - b_calibrated,v| of the streaming fit, both centred (softmax ignores a
        constant), in logits (b is stored as u·b, so a step of T alone moves it too)."""
        current = self.fit.correction.bias  # centred
        return float((current - self._calibrated_centred.to(current)).abs().max())

    def _held_requests(self) -> int:
        """The distinct requests in the reservoir."""
        return len(self._held_ids)

    def status(self) -> dict[str, int | float]:
        """Choices seen (`requests`), rows the fit stepped on, whether it steps in the output
        head's span (1) or per token only (0), held-out requests and rows; the share of the
        calibrated start's penalty in force (`StreamingBias.anchor_share`) and how far the fit
        has moved from the calibrated bias (`max_change_from_calibrated`, the largest change of
        one token's bias, in logits, as of the last step): a fit that stays at 0 while rows
        come, or one the gate never publishes, is visible here."""
        return {
            "requests": self.requests,
            "rows_fitted": self.fit.rows_seen,
            "head_span": int(self.fit.steps_in_head_span),
            "holdout_requests": self._held_requests(),
            "holdout_rows": self._held_rows,
            "anchor_share": self.fit.anchor_share,
            "max_change_from_calibrated": self._change_from_calibrated,
        }
