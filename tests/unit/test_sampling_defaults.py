"""The model's generation-config sampling defaults (vLLM's ``--generation-config auto``) fill
the fields a request leaves unset, on both generation endpoints, as on vLLM's server."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import MODEL, POLICY, build

from noisy_temp_server.settings import Settings

DEFAULTS = {"temperature": 0.3, "top_p": 0.8, "top_k": 5, "min_p": 0.05, "max_tokens": 6}
ENDPOINTS = {
    "/v1/completions": {"model": MODEL, "prompt": "abc", "max_tokens": 50},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
}


def _params(body: dict[str, Any], path: str, defaults: dict[str, Any] | None) -> Any:
    harness = build(Settings(), POLICY, sampling_defaults=defaults)
    response = harness.post(path, body)
    assert response.status_code == 200, response.text
    ((_, params, _),) = harness.engine.calls
    return params


@pytest.mark.parametrize("path", ENDPOINTS)
def test_unset_fields_take_the_models_defaults(path: str) -> None:
    params = _params(ENDPOINTS[path], path, DEFAULTS)
    assert params.temperature == pytest.approx(0.3)
    assert (params.top_p, params.top_k, params.min_p) == (pytest.approx(0.8), 5, 0.05)
    assert params.max_tokens == 6  # the model's cap, under what the request asks


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fields_the_request_sets_win(path: str) -> None:
    body = {**ENDPOINTS[path], "temperature": 0.9, "top_k": 2, "max_tokens": 3}
    params = _params(body, path, DEFAULTS)
    assert (params.temperature, params.top_k, params.max_tokens) == (pytest.approx(0.9), 2, 3)
    assert params.top_p == pytest.approx(0.8)


def test_without_defaults_an_unset_field_takes_openais_default() -> None:
    params = _params(ENDPOINTS["/v1/chat/completions"], "/v1/chat/completions", None)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
