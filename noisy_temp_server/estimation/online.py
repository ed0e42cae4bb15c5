"""The online estimator: live pair records in, new temperature policy versions out.

The server's shadow scorer scores a sample of finished requests with the clean and the served
model and hands each request's `PositionRecords` to `OnlineEstimator.add`. The estimator keeps a
bounded window of the most recent records and, once it holds `min_positions` positions and at
least `refit_every` new ones arrived since the last fit, refits with the calibration code
(`fit_rules`) what the served rule needs: alpha / sigma2 by step bucket always (they also feed
the metrics), plus the best shared T for `fixed`, the floor for `fisher`, (t_max, beta) for
`schedule`, or the table for `calibrated` (fitted top-down with a significance check at every
split). It publishes a new `TemperaturePolicy` whose version is one higher, in which the other
rules' parameters (which a request may select by override) stay as they were. A calibrated table
with request-temperature bands (from a profile) is kept as it is: the shadow records are
measured at request temperature 1 and cannot refit the other bands. The rule served
stays the one it started with, except that a profile recommending `off` starts on `calibrated`
with the profile's table: that table is significance-gated (all ones where nothing beat T = 1),
so it serves T = 1 until the live evidence says otherwise instead of pinning the server at
T = 1 for good. A profile (or policy) that serves the per-token bias keeps the bias and its T
as calibrated (the records cannot refit a T that was fitted jointly with the bias); only
alpha / sigma2 are refitted then.

Without a profile or policy it starts on the `calibrated` rule with an all-ones table, i.e. it
serves T = 1 until the evidence says otherwise. All methods are thread-safe; `add` does the fit
in the calling thread (the shadow loop's background thread) without blocking `current_policy`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from noisy_temp_server.estimation.fitting import fit_rules
from noisy_temp_server.estimation.profile import CalibrationSettings, Profile, StepBucketNoise
from noisy_temp_server.pairs.scorer import PositionRecords
from noisy_temp_server.temperature.policy import TemperaturePolicy
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


class OnlineEstimator:
    """Refits the temperature policy from a window of recent pair records (see module doc).

    Args:
        initial: a `Profile` (its recommended rule, `calibrated` when that is `off`; its
            parameters and fit settings), a `TemperaturePolicy` (its rule and bounds are kept),
            or None (calibrated rule, T = 1).
        min_positions: positions needed in the window before the first refit.
        refit_every: new positions needed between refits.
        window_positions: the window keeps at least the most recent this-many positions
            (whole requests; older requests are dropped).
        settings: fit settings (step buckets, entropy buckets, evidence per cell); default: the
            profile's, else `CalibrationSettings()` with the initial policy's bounds.
        clock: returns the wall time in seconds (injectable for tests).
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
    ) -> None:
        if min_positions < 1 or refit_every < 1 or window_positions < min_positions:
            raise ValueError(
                "need min_positions >= 1, refit_every >= 1 and window_positions >= min_positions"
            )
        if isinstance(initial, Profile) and initial.to_policy().bias is not None:
            policy = initial.to_policy()  # the bias with its T, kept as calibrated
            settings = settings or initial.settings
        elif isinstance(initial, Profile):
            recommended = initial.recommended_rule
            policy = initial.to_policy(Rule.CALIBRATED if recommended is Rule.OFF else recommended)
            settings = settings or initial.settings
        elif isinstance(initial, TemperaturePolicy):
            policy = initial
        else:
            policy = TemperaturePolicy(rule=Rule.CALIBRATED)
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
        self._lock = threading.Lock()
        self._refit_lock = threading.Lock()

    def add(self, records: PositionRecords) -> None:
        """Add one finished request's records; refits (in this thread) when it is due."""
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
                parameters, noise = fit_rules(window, self._settings, self._fitted_rules)
            except ValueError as error:
                with self._lock:
                    self._last_error = f"refit on {len(window)} positions failed: {error}"
                logger.warning("%s", self._last_error)
                return False
            with self._lock:
                previous = self._policy
                fitted = parameters.to_policy(previous.rule, previous.version + 1)
                kept = {
                    name: getattr(previous, name)
                    for rule, names in _PARAMETERS_OF_RULE.items()
                    if rule not in self._fitted_rules
                    for name in names
                }
                self._policy = dataclasses.replace(
                    fitted, bounds=previous.bounds, bias=previous.bias, **kept
                )
                self._noise = tuple(noise)
                self._last_refit = self._clock()
                self._last_error = None
            logger.info("published policy version %d", self._policy.version)
            return True
        finally:
            self._refit_lock.release()

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
                "window_requests": len(self._window),
                "last_refit_time": self._last_refit,
                "healthy": self._last_error is None,
                "last_error": self._last_error,
                "mean_window_kl_at_one": (
                    float(torch.cat([r.kl_at_one for r in self._window]).double().mean())
                    if self._window
                    else None
                ),
            }
