"""Loading a script of the repository (benchmarks/, scripts/) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: Path, name: str) -> ModuleType:
    """The script at `path` imported as module `name`, with its folder on sys.path as when it
    runs as a script (its sibling modules import), and registered in sys.modules (its
    dataclasses look their module up)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
