"""Any bad `Authorization` header is a 401 with an OpenAI error body, never a 500."""

from __future__ import annotations

import pytest
from server_fakes import (
    POLICY,
    assert_error,
    build,
)

from noisy_temp_server.settings import Settings

KEY = "sekrit-\u00e9"  # a non-ASCII key works too (compared as UTF-8 bytes)
BODY = {"prompt": "abc", "max_tokens": 1}


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"Bearer",
        b"Bearer ",
        b"Bearer wrong",
        b"Basic " + KEY.encode(),
        b"bearer\t" + KEY.encode(),
        "Bearer sekrit-\u00e9\u00e9".encode(),
        "Bearer \u2603".encode(),
        b"Bearer \xff\xfe\x80",
        "Bearer \u00e9".encode("latin-1"),
        KEY.encode(),
    ],
)
def test_a_bad_authorization_header_is_a_401(header: bytes) -> None:
    harness = build(Settings(api_key=KEY), POLICY)  # type: ignore[arg-type]
    response = harness.client.post("/v1/completions", json=BODY, headers={"Authorization": header})
    assert_error(response, 401, "invalid_api_key")
    assert harness.engine.calls == []


def test_the_right_key_is_accepted_whatever_the_scheme_case() -> None:
    harness = build(Settings(api_key=KEY), POLICY)  # type: ignore[arg-type]
    for scheme in (b"Bearer ", b"bearer ", b"BEARER  "):
        response = harness.client.post(
            "/v1/completions", json=BODY, headers={"Authorization": scheme + KEY.encode()}
        )
        assert response.status_code == 200, response.text
