"""Logging a long step (of startup, say) with its duration."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

__all__ = ["logged_phase"]


@contextlib.contextmanager
def logged_phase(logger: logging.Logger, what: str) -> Iterator[None]:
    """Log `what ...` at INFO on `logger`, run the block, then `what: done in <s> s`; nothing is
    logged as done when the block raises (the exception goes on)."""
    logger.info("%s ...", what)
    started = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - started)
