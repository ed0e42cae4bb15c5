"""The online estimator: live pair records in, new temperature policy versions out.

The server's shadow scorer scores a sample of finished requests with the clean and the served
model and hands each request's `PositionRecords` to `OnlineEstimator.add`. The estimator keeps a
bounded window of the most recent records and, once it holds `min_positions` positions and at
least `refit_every` new ones arrived since the last fit, refits with the calibration code
(`fit_rules`) what the served rule needs: alpha / sigma2 by step bucket always (they also feed
the metrics), plus the best shared T for `fixed`, the floor for `fisher`, (t_max, beta) for
`schedule`, or the table for `calibrated` (fitted top-down with a significance check at every
split); a refit of the first three is fitted on all but `settings.validation_fraction` of the
window's requests and published only when it is not significantly worse than T = 1 on those
(`is_not_worse`), else the rule keeps its previous parameters (`status()`'s
`refits_kept_previous` counts it). It publishes a new `TemperaturePolicy` whose version is one
higher, in which the other rules' parameters (which a request may select by override) stay as
they were. A calibrated table with request-temperature bands (from a profile) is kept as it is:
the shadow records are measured at request temperature 1 and cannot refit the other bands. The
rule served stays the one it started with, except that a profile recommending `off` starts on
`calibrated`, so that the live evidence can still move T away from 1 instead of pinning the
server at T = 1 for good: with the profile's table when it has one request-temperature band (it
is significance-gated, all ones where nothing beat T = 1), else (calibration's default makes 4
bands, which the online refit cannot refit) with a one-band all-ones table, i.e. T = 1, as the
profile recommends, until the online refit, on the records at T_r = 1, finds a split that beats
it; that table then serves every request temperature alike, as without a profile. A profile (or
policy) that serves the per-token bias keeps its T as calibrated (the records cannot refit a T
that was fitted jointly with the bias); alpha / sigma2 are refitted as always. Given a folder to
publish biases to (`online_bias_dir`, writable) and a profile that serves a bias (its file found
in `bias_dirs`), the bias and its T are refined online from the shadow scorer's
paired rows (`add(records, rows)`; `online.bias.OnlineBias`: a streaming fit with the
profile's penalty, a held-out reservoir) and, at a refit, published in the new policy version
when they beat the published ones on the held-out rows by more than two standard errors (a
bias served in request-temperature bands has its bands refined on the same rows, taken to
each T_r, and is published only if not significantly worse at any of them): the vector is
written once (atomically) to `online_bias_dir` (`bias-<sha256>.safetensors`), and the policy
names it by hash, so the engine must look for bias files there too. A published bias's file is
deleted only once it is beyond the last `kept_bias_files` published and the next one was
published `kept_bias_seconds` ago or more (a request pins its policy when it is prepared and the
engine loads the bias when it admits it, maybe after a wait in its queue; a file missing then
would serve the request its T without the bias that T was fitted with); never the profile's. A
write that fails (OSError: a read-only or full folder) publishes the version without the new
bias (the served bias and its T stay, alpha / sigma2 are new), is counted and marks the
estimator unhealthy until a bias is written.

Without a profile or policy it starts on the `calibrated` rule with an all-ones table, i.e. it
serves T = 1 until the evidence says otherwise. All methods are thread-safe; `add` does the fit
in the calling thread (the shadow loop's background thread) without blocking `current_policy`
(its step of the online bias waits for a refit running in another thread).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from noisy_temp_server.calibration.fitting import finite_positions, fit_rules, rule_temperatures
from noisy_temp_server.calibration.profile import Profile, StepBucketNoise
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.calibration.significance import (
    is_not_worse,
    split_by_sequence,
)
from noisy_temp_server.correction.files import (
    bias_file_name,
    bias_sha256,
    find_bias_file,
    save_bias_file,
)
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows
from noisy_temp_server.online.bias import OnlineBias
from noisy_temp_server.scoring.records import PositionRecords, interpolate_kl
from noisy_temp_server.scoring.standard_error import cluster_stderr
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

__all__ = ["OnlineEstimator"]

logger = logging.getLogger(__name__)

_PARAMETERS_OF_RULE: dict[Rule, tuple[str, ...]] = {
    Rule.FIXED: ("fixed_temperature",),
    Rule.FISHER: ("fisher_var_floor",),
    Rule.SCHEDULE: ("schedule_t_max", "schedule_beta"),
    Rule.CALIBRATED: ("calibrated",),
}
"""`TemperaturePolicy` fields fitted for one rule only (alpha / sigma2 are always fitted)."""
_GATED_RULES = frozenset({Rule.FIXED, Rule.FISHER, Rule.SCHEDULE})
"""Rules whose online refit is published only when it is not significantly worse than T = 1 on
held-out requests of the window (`calibrated` checks every split of its table itself)."""


def _not_worse_than_one(policy: TemperaturePolicy, held_out: PositionRecords) -> bool:
    """Whether `policy`'s rule is not significantly worse than T = 1 on `held_out` (its mean
    paired KL gain over T = 1 plus two standard errors clustered by request is >= 0,
    `significance.is_not_worse`); True when nothing is held out."""
    if not len(held_out):
        return True
    served = interpolate_kl(
        held_out.kl_curve, held_out.curve_temperatures, rule_temperatures(policy, held_out)
    )
    gain = held_out.kl_at_one.double() - served.double()
    return is_not_worse(float(gain.mean()), cluster_stderr(gain, held_out.sequence_id))


def _starting_policy(initial: Profile | TemperaturePolicy | None) -> TemperaturePolicy:
    """The policy the estimator starts from (see the module docstring): a profile's (the bias
    with its T kept as calibrated; `calibrated` in place of `off`, with a one-band table), a
    given policy, or the calibrated rule at T = 1."""
    if isinstance(initial, TemperaturePolicy):
        return initial
    if initial is None:
        return TemperaturePolicy(rule=Rule.CALIBRATED)
    if initial.to_policy().bias is None and initial.recommended_rule is Rule.OFF:
        policy = initial.to_policy(Rule.CALIBRATED)
        if len(policy.calibrated.request_temperature_edges) > 1:  # not refittable online
            policy = dataclasses.replace(policy, calibrated=CalibratedTable())
        return policy
    return initial.to_policy()


class OnlineEstimator:
    """Refits the temperature policy from a window of recent pair records (see module doc).

    Args:
        initial: a `Profile` (its recommended rule, `calibrated` when that is `off`, see the
            module docstring; its parameters and fit settings), a `TemperaturePolicy` (its
            rule and bounds are kept), or None (calibrated rule, T = 1).
        min_positions: positions needed in the window before the first refit.
        refit_every: new positions needed between refits.
        window_positions: the window keeps at least the most recent this-many positions
            (whole requests; older requests are dropped).
        settings: fit settings (step buckets, entropy buckets, evidence per cell); default: the
            profile's, else `CalibrationSettings()` with the initial policy's bounds.
        clock: returns the wall time in seconds (injectable for tests).
        bias_dirs: the folders the profile's bias file is looked up in, in order.
        online_bias_dir: where published online biases are written; with it and a profile that
            serves a bias, the bias is refined online (see the module docstring) and the folder
            is created here if missing (its parent must exist: FileNotFoundError), never
            later, so a write after the server removed it fails (counted, see above) rather
            than create it again. ValueError when the profile's bias file is in none of
            `bias_dirs`.
        kept_bias_files: files of the most recent published online biases kept in
            `online_bias_dir`.
        kept_bias_seconds: a published online bias's file is kept at least this long after the
            next one was published (by `clock`), whatever `kept_bias_files` says: longer than
            any request waits between its preparation and its admission by the engine.
        head_basis: the clean model's output head [V, d]; when the profile's bias has a part
            in its span, the online refinement steps in that span too (`StreamingBias`).
    """

    def __init__(
        self,
        initial: Profile | TemperaturePolicy | None = None,
        *,
        min_positions: int = 500,
        refit_every: int = 500,
        window_positions: int = 50_000,
        settings: CalibrationSettings | None = None,
        clock: Callable[[], float] = time.time,
        bias_dirs: Sequence[Path] = (),
        online_bias_dir: Path | None = None,
        kept_bias_files: int = 4,
        kept_bias_seconds: float = 600.0,
        head_basis: torch.Tensor | None = None,
    ) -> None:
        if min_positions < 1 or refit_every < 1 or window_positions < min_positions:
            raise ValueError(
                "need min_positions >= 1, refit_every >= 1 and window_positions >= min_positions"
            )
        if kept_bias_files < 1:
            raise ValueError("need kept_bias_files >= 1 (the served bias's file)")
        policy = _starting_policy(initial)
        if settings is None and isinstance(initial, Profile):
            settings = initial.settings
        self._settings = settings or CalibrationSettings(
            t_min=policy.bounds.t_min, t_max=policy.bounds.t_max
        )
        self._policy = policy
        self._fitted_rules = frozenset({policy.rule}) & _PARAMETERS_OF_RULE.keys()
        if policy.bias is not None:
            # its T was fitted jointly with the bias; a T-only refit would not be
            self._fitted_rules = frozenset()
        if len(policy.calibrated.request_temperature_edges) > 1:
            # shadow records are measured at request temperature 1: keep the profile's bands
            self._fitted_rules -= {Rule.CALIBRATED}
        self._noise: tuple[StepBucketNoise, ...] = (
            initial.noise_by_step if isinstance(initial, Profile) else ()
        )
        self._min_positions = min_positions
        self._refit_every = refit_every
        self._window_positions = window_positions
        self._clock = clock
        self._window: deque[PositionRecords] = deque()
        self._window_size = 0
        self._positions_seen = 0
        self._since_refit = 0
        self._last_refit: float | None = None
        self._last_error: str | None = None
        self._gate_refusals = 0
        self._lock = threading.Lock()
        self._refit_lock = threading.Lock()
        self._online_bias_dir = online_bias_dir
        self._kept_bias_files = kept_bias_files
        self._kept_bias_seconds = kept_bias_seconds
        # (sha256, publication time) of our files, oldest first
        self._written_biases: deque[tuple[str, float]] = deque()
        self._profile_bias = policy.bias
        self._bias_error: str | None = None
        self._bias_write_failures = 0
        self._bias: OnlineBias | None = None
        profile = initial if isinstance(initial, Profile) else None
        if online_bias_dir is not None and profile is not None:
            self._bias = self._refined_bias(profile, bias_dirs, head_basis)
            if self._bias is not None:
                online_bias_dir.mkdir(exist_ok=True)

    def _refined_bias(
        self, profile: Profile, bias_dirs: Sequence[Path], head_basis: torch.Tensor | None
    ) -> OnlineBias | None:
        """The online refinement of the profile's bias (None when the policy serves none or the
        profile records no penalty to refine it with), its file found in `bias_dirs` (ValueError
        when missing)."""
        policy, summary = self._policy, profile.bias
        if not policy.bias or summary is None or not summary.penalty:
            return None
        vector = find_bias_file(bias_dirs, policy.bias)
        return OnlineBias.refining(
            LogitBias(bias=vector, temperature=summary.temperature),  # its T at T_r = 1
            summary,
            request_temperatures=profile.settings.request_temperatures,
            head_basis=head_basis,
            fallback_prior_rows=self._settings.bias_rows,
            bounds=policy.bounds,
        )

    @property
    def reads_kl_curves(self) -> bool:
        """Whether a refit reads the records' KL curves (it refits a rule's T); else only
        alpha / sigma2 are refitted and the scorer may leave the curves out."""
        return bool(self._fitted_rules)

    @property
    def refines_bias(self) -> bool:
        """Whether `add` wants the paired rows (the bias is refined online)."""
        return self._bias is not None

    def add(self, records: PositionRecords, rows: PairedRows | None = None) -> None:
        """Add one finished request's records (and, when `refines_bias`, paired rows of some
        of its positions); refits (in this thread) when it is due."""
        if self._bias is not None and rows is not None:
            with self._refit_lock:  # a refit in another thread reads the fit and reservoir
                self._bias.add(rows)
        if len(records) == 0:
            return
        with self._lock:
            self._window.append(records)
            self._window_size += len(records)
            while self._window_size - len(self._window[0]) >= self._window_positions:
                self._window_size -= len(self._window.popleft())
            self._positions_seen += len(records)
            self._since_refit += len(records)
            due = (
                self._window_size >= self._min_positions and self._since_refit >= self._refit_every
            )
        if due:
            self.refit()

    def refit(self) -> bool:
        """Refit on the current window and publish a new policy version; False if skipped.

        Skipped when another refit is running. A failed fit (e.g. too few requests) keeps the
        current policy and marks the estimator unhealthy until a fit succeeds.
        """
        if not self._refit_lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                window = PositionRecords.concat(list(self._window))
                self._since_refit = 0
            try:
                fit_on, check = self._split_for_the_gate(window)
                parameters, noise = fit_rules(fit_on, self._settings, self._fitted_rules)
            except ValueError as error:
                with self._lock:
                    self._last_error = f"refit on {len(window)} positions failed: {error}"
                logger.warning("%s", self._last_error)
                return False
            published_bias = self._publish_bias()
            with self._lock:
                previous = self._policy
                fitted = parameters.to_policy(previous.rule, previous.version + 1)
                refitted = self._fitted_rules
                if check is not None and not _not_worse_than_one(fitted, check):
                    refitted = refitted - _GATED_RULES
                    self._gate_refusals += 1
                    logger.info(
                        "the refitted %s is worse than T = 1 on held-out requests: "
                        "keeping its previous parameters",
                        previous.rule.value,
                    )
                kept = {
                    name: getattr(previous, name)
                    for rule, names in _PARAMETERS_OF_RULE.items()
                    if rule not in refitted
                    for name in names
                }
                kept = {"bias": previous.bias, **kept}
                policy = dataclasses.replace(fitted, bounds=previous.bounds, **kept)
                if published_bias is not None:
                    policy = policy.serving_bias(*published_bias)
                self._policy = policy
                self._noise = tuple(noise)
                self._last_refit = self._clock()
                self._last_error = None
            logger.info("published policy version %d", self._policy.version)
            return True
        finally:
            self._refit_lock.release()

    def _split_for_the_gate(
        self, window: PositionRecords
    ) -> tuple[PositionRecords, PositionRecords | None]:
        """(the records to fit on, the held-out ones to gate the refit against T = 1 with):
        when a rule of `_GATED_RULES` is refitted, `settings.validation_fraction` of the
        window's requests are held out (InsufficientDataError, a ValueError, with fewer than
        two); else the whole window and None (`calibrated` gates each split itself)."""
        if not self._fitted_rules & _GATED_RULES:
            return window, None
        fit_on, held_out = split_by_sequence(
            window.sequence_id, self._settings.validation_fraction, self._settings.seed
        )
        return window.select(fit_on), finite_positions(window.select(held_out))

    def _publish_bias(self) -> tuple[str, Mapping[float, float]] | None:
        """(sha256, its T at each request temperature) of the online bias for the next version
        (`TemperaturePolicy.serving_bias`) when it is significantly better on the held-out rows
        and its vector was written to `online_bias_dir`, else None (a failed write is
        recorded, see the module docstring)."""
        if self._bias is None or self._online_bias_dir is None:
            return None
        candidate = self._bias.candidate()
        if candidate is None:
            return None
        sha256 = bias_sha256(candidate.correction.bias)
        try:
            save_bias_file(self._online_bias_dir, candidate.correction.bias)
        except OSError as error:
            with self._lock:
                self._bias_write_failures += 1
                self._bias_error = (
                    f"cannot write the online bias to {self._online_bias_dir}: {error}; "
                    "the published bias stays"
                )
            logger.error("%s", self._bias_error)
            return None
        with self._lock:
            self._bias_error = None
        self._bias.published = candidate
        self._forget_old_bias_files(sha256)
        logger.info("the online bias beats the published one on held-out rows: publishing it")
        return sha256, candidate.band_temperatures

    def _forget_old_bias_files(self, written: str) -> None:
        """Record the file of `written` and delete those of older published biases beyond
        `kept_bias_files` whose successor was published `kept_bias_seconds` ago or more (never
        the profile's, nor one published again since)."""
        assert self._online_bias_dir is not None
        now = self._clock()
        self._written_biases.append((written, now))
        while (
            len(self._written_biases) > self._kept_bias_files
            and now - self._written_biases[1][1] >= self._kept_bias_seconds
        ):
            stale, _ = self._written_biases.popleft()
            if stale == self._profile_bias or any(s == stale for s, _ in self._written_biases):
                continue
            try:
                (self._online_bias_dir / bias_file_name(stale)).unlink(missing_ok=True)
            except OSError as error:
                logger.warning("cannot delete the old online bias %s: %s", stale[:16], error)

    def _bias_status(self) -> dict[str, Any]:
        """The online bias's state (`OnlineBias.status`), where it publishes, and how many of
        its writes failed."""
        assert self._bias is not None
        return {
            **self._bias.status(),
            "folder": str(self._online_bias_dir),
            "write_failures": self._bias_write_failures,
        }

    def current_policy(self) -> TemperaturePolicy:
        """The latest published policy (an immutable snapshot)."""
        with self._lock:
            return self._policy

    def status(self) -> dict[str, Any]:
        """JSON-ready state: policy version and rule, noise by step bucket, counts, health."""
        with self._lock:
            return {
                "policy_version": self._policy.version,
                "rule": self._policy.rule.value,
                "step_buckets": [n.model_dump() for n in self._noise],
                "alpha_by_step": list(self._policy.alpha_by_step),
                "sigma2_by_step": list(self._policy.sigma2_by_step),
                "positions_seen": self._positions_seen,
                "window_positions": self._window_size,
                # the n choices of a request share its sequence id
                "window_requests": len({int(r.sequence_id[0]) for r in self._window}),
                "last_refit_time": self._last_refit,
                "refits_kept_previous": self._gate_refusals,
                "healthy": self._last_error is None and self._bias_error is None,
                "last_error": self._last_error or self._bias_error,
                "bias": None if self._bias is None else self._bias_status(),
                "mean_window_kl_at_one": (
                    float(torch.cat([r.kl_at_one for r in self._window]).double().mean())
                    if self._window
                    else None
                ),
            }
