"""Validation of policy fields: each check returns the normalised value or raises
`PolicyValidationError` naming the field and what is expected."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TypeGuard

from noisy_temp_server.temperature.rules import Rule

__all__ = [
    "MAX_STEP_EDGE",
    "MAX_STEP_EDGES",
    "PolicyValidationError",
    "entropy_edges",
    "fail",
    "number",
    "per_bucket",
    "rule",
    "sequence",
    "sha256",
    "step_edges",
]

MAX_STEP_EDGES = 64
"""Most step buckets a step table may have (the processor's per-slot tables, the histogram's
labels and the state copied to the host each step grow with it)."""
MAX_STEP_EDGE = 2**31 - 2
"""Largest step edge: the processor keys step ``e`` of slot ``s`` as ``s * 2**32 + e`` and pads
unused buckets with ``2**32 - 1``, so every edge and step must stay below that."""


class PolicyValidationError(ValueError):
    """A policy (or its JSON) is malformed; the message names the field and what is expected."""


def fail(field: str, expected: str, value: object) -> PolicyValidationError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return PolicyValidationError(f"policy field {field!r} must be {expected}, got {shown}")


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def number(field: str, value: object, *, positive: bool = False) -> float:
    """A finite float, > 0 if ``positive`` else >= 0."""
    expected = "a finite number > 0" if positive else "a finite number >= 0"
    if not is_number(value) or not math.isfinite(value):
        raise fail(field, expected, value)
    if value < 0 or (positive and value == 0):
        raise fail(field, expected, value)
    return float(value)


def sequence(field: str, value: object, expected: str) -> Sequence[object]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise fail(field, expected, value)
    return value


def check_ascending(field: str, expected: str, edges: Sequence[float], original: object) -> None:
    if not edges or edges[0] != 0 or any(b <= a for a, b in itertools.pairwise(edges)):
        raise fail(field, expected, original)


def step_edges(field: str, value: object) -> tuple[int, ...]:
    expected = (
        f"a non-empty list of at most {MAX_STEP_EDGES} strictly ascending integers starting at 0,"
        f" each <= {MAX_STEP_EDGE}"
    )
    items = sequence(field, value, expected)
    if len(items) > MAX_STEP_EDGES:
        raise fail(field, expected, value)
    edges = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item > MAX_STEP_EDGE:
            raise fail(field, expected, value)
        edges.append(item)
    check_ascending(field, expected, edges, value)
    return tuple(edges)


def entropy_edges(field: str, value: object) -> tuple[float, ...]:
    expected = "a non-empty list of strictly ascending finite numbers starting at 0"
    edges = []
    for item in sequence(field, value, expected):
        if not is_number(item) or not math.isfinite(item):
            raise fail(field, expected, value)
        edges.append(float(item))
    check_ascending(field, expected, edges, value)
    return tuple(edges)


def rule(value: object) -> Rule:
    if isinstance(value, str):
        try:
            return Rule(value)
        except ValueError:
            pass
    raise fail("rule", f"one of: {' '.join(r.value for r in Rule)}", value)


def per_bucket(field: str, value: object, buckets: int, *, positive: bool) -> tuple[float, ...]:
    expected = (
        f"a list of {buckets} finite numbers {'> 0' if positive else '>= 0'} (one per bucket)"
    )
    items = sequence(field, value, expected)
    if len(items) != buckets:
        raise fail(field, expected, value)
    try:
        return tuple(number(field, x, positive=positive) for x in items)
    except PolicyValidationError:
        raise fail(field, expected, value) from None


def sha256(field: str, value: object) -> str:
    """A sha256 content hash: 64 lowercase hex digits."""
    if not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef"):
        raise fail(field, "a sha256 hash (64 lowercase hex digits)", value)
    return value
