"""Recording which of a module's functions a piece of code calls, without changing them."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import pytest

__all__ = ["record_calls"]


def record_calls(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: Iterable[str]
) -> list[str]:
    """Wrap `module.<name>` for each name so every call appends the name to the returned list
    (and then runs the original); `monkeypatch` undoes it after the test."""
    calls: list[str] = []
    for name in names:
        original = getattr(module, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls
