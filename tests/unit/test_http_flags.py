"""vllm serve's HTTP flags on `serve`, with vLLM's meaning: CORS (`--allowed-origins`...), the
root path, uvicorn's log level and access log, TLS."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_fakes import POLICY, build

from noisy_temp_server import cli
from noisy_temp_server.server.launch import uvicorn_config
from noisy_temp_server.settings import Settings

PREFLIGHT = {"Access-Control-Request-Method": "POST"}


def test_no_origin_is_allowed_by_default_as_in_vllm() -> None:
    harness = build(Settings(), POLICY)
    response = harness.client.get("/health", headers={"Origin": "https://site.example"})
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    preflight = harness.client.options(
        "/v1/chat/completions", headers={"Origin": "https://site.example", **PREFLIGHT}
    )
    assert preflight.status_code == 400


def test_allowed_origins_answer_preflights_and_requests() -> None:
    harness = build(Settings(allowed_origins='["https://site.example"]'), POLICY)
    allowed = {"Origin": "https://site.example"}
    preflight = harness.client.options("/v1/chat/completions", headers={**allowed, **PREFLIGHT})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://site.example"
    response = harness.client.get("/health", headers=allowed)
    assert response.headers["access-control-allow-origin"] == "https://site.example"
    other = harness.client.options(
        "/v1/chat/completions", headers={"Origin": "https://other.example", **PREFLIGHT}
    )
    assert other.status_code == 400


def test_the_root_path_reaches_the_app() -> None:
    harness = build(Settings(root_path="/llm"), POLICY)
    assert harness.client.app.root_path == "/llm"  # type: ignore[attr-defined]
    assert harness.client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_uvicorn_gets_the_log_level_access_log_and_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    settings = Settings(
        uvicorn_log_level="warning",
        disable_uvicorn_access_log=True,
        ssl_keyfile=key,
        ssl_certfile=cert,
        ssl_cert_reqs=2,
    )
    config = uvicorn_config(settings, object(), "info")
    assert (config.log_level, config.access_log) == ("warning", False)
    assert (config.ssl_keyfile, config.ssl_certfile, config.ssl_cert_reqs) == (key, cert, 2)
    default = uvicorn_config(Settings(), object(), "debug")
    assert (default.log_level, default.access_log, default.ssl_certfile) == ("debug", True, None)


def test_the_flags_parse_as_vllm_serve_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []
    monkeypatch.setattr(
        "noisy_temp_server.server.launch.serve", lambda settings, _: seen.append(settings) or 0
    )
    argv = ["serve", "--allowed-origins", '["*"]', "--allow-credentials", "--ssl-cert-reqs", "1"]
    assert cli.main(argv) == 0
    (settings,) = seen
    assert settings.allowed_origins == ("*",)
    assert settings.allow_credentials is True
    assert settings.ssl_cert_reqs == 1
    assert settings.vllm_args == ""


def test_a_cors_list_that_is_not_json_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a JSON list"):
        Settings(allowed_origins="https://site.example")
