"""`serve` warns at start when it listens beyond loopback without an API key."""

from __future__ import annotations

import logging

import pytest

from noisy_temp_server.server.exposure import listens_beyond_loopback, warn_if_open_without_api_key
from noisy_temp_server.settings import Settings


@pytest.mark.parametrize(
    ("host", "beyond"),
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("localhost", False),
        ("::1", False),
        ("[::1]", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.1.2.3", True),
        ("example.internal", True),
    ],
)
def test_which_hosts_listen_beyond_loopback(host: str, beyond: bool) -> None:
    assert listens_beyond_loopback(host) is beyond


def test_an_open_bind_without_a_key_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="noisy_temp_server.serve"):
        assert warn_if_open_without_api_key(Settings(host="0.0.0.0", port=8123))
    assert "without an API key" in caplog.text
    assert "0.0.0.0" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [Settings(), Settings(host="0.0.0.0", api_key="k")],  # type: ignore[arg-type]
)
def test_loopback_or_a_key_gives_no_warning(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert not warn_if_open_without_api_key(settings)
    assert caplog.text == ""
