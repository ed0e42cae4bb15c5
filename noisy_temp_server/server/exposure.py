"""Whether the server is reachable beyond this machine, and the warning when it is without an
API key."""

from __future__ import annotations

import ipaddress
import logging

from noisy_temp_server.settings import Settings

__all__ = ["listens_beyond_loopback", "warn_if_open_without_api_key"]

_LOGGER = logging.getLogger(__name__)


def listens_beyond_loopback(host: str) -> bool:
    """Whether binding `host` may accept connections from other machines (a name other than
    `localhost` counts, since it may resolve anywhere)."""
    if host.strip().lower() == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return True


def warn_if_open_without_api_key(settings: Settings) -> bool:
    """Log a warning (and return True) when the server will listen beyond loopback with no API
    key: anyone who can reach the port can then use the model."""
    if settings.api_key is not None or not listens_beyond_loopback(settings.host):
        return False
    _LOGGER.warning(
        "Listening on %s without an API key: anyone who can reach port %d can use this server. "
        "Set --api-key (NTS_API_KEY), or bind 127.0.0.1 behind a proxy that authenticates.",
        settings.host,
        settings.port,
    )
    return True
