"""The shadow scorer's CPU budget: a token bucket of CPU seconds (see `online.shadow`)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CpuBudget"]


class CpuBudget:
    """A token bucket of CPU seconds: credit grows at ``share`` x ``cores`` CPU-seconds per
    wall-second, up to ``horizon_s`` seconds' worth; `take` spends (it may leave the credit
    negative: a debt repaid by time), and is refused while the credit is not positive;
    `give` returns what was taken and not spent. ``share`` >= 1: no limit. Not thread-safe
    (the scorer holds its lock)."""

    def __init__(
        self,
        share: float,
        cores: int,
        *,
        horizon_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cores < 1:
            raise ValueError(f"need cores >= 1, got {cores}")
        self.cores = cores
        self._clock = clock
        self._last = clock()
        self.share = 1.0
        self.horizon_s = 1.0
        self.credit = 0.0
        self.set_share(share, horizon_s)

    def set_share(self, share: float, horizon_s: float) -> None:
        """A new share of the machine and horizon, from now on (the credit starts full)."""
        if not share > 0.0 or not horizon_s > 0.0:
            raise ValueError(f"need a CPU share and horizon > 0, got {share}, {horizon_s}")
        self._refill()
        self.share = share
        self.horizon_s = horizon_s
        self.credit = self._capacity

    @property
    def _capacity(self) -> float:
        return self.share * self.cores * self.horizon_s

    def _refill(self) -> None:
        now = self._clock()
        gained = self.share * self.cores * (now - self._last)
        self.credit = min(self._capacity, self.credit + gained)
        self._last = now

    def take(self, seconds: float) -> bool:
        """Spend `seconds` of CPU if any credit is left; False (nothing spent) otherwise."""
        if self.share >= 1.0:
            return True
        self._refill()
        if self.credit <= 0.0:
            return False
        self.credit -= seconds
        return True

    def give(self, seconds: float) -> None:
        """Return `seconds` taken and not spent (negative: spend more than was taken)."""
        self._refill()
        self.credit = min(self._capacity, self.credit + seconds)
