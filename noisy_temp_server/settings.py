"""The one typed settings object of noisy-temp-server.

Values come, in rising precedence, from the defaults here, environment variables prefixed
`NTS_` (e.g. `NTS_CACHE_DIR`), and CLI flags (which build a `Settings` with overrides). A bad
value is an error at startup, never silently replaced.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "default_cache_dir"]


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/noisy-temp-server`, or `~/.cache/noisy-temp-server`."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "noisy-temp-server"


class Settings(BaseSettings):
    """Server-wide settings. Per-request overrides travel in the request (see the server)."""

    model_config = SettingsConfigDict(env_prefix="NTS_", extra="forbid", frozen=True)

    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where converted and perturbed checkpoints are kept.",
    )
