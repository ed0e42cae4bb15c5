"""/openapi.json documents what the server really answers (the fuzzing in
tests/e2e/test_fuzz_openapi.py checks the responses against it)."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import (
    POLICY,
    build,
)

from noisy_temp_server.settings import Settings


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return dict(build(Settings(), POLICY).client.get("/openapi.json").json())


def _responses(document: dict[str, Any], path: str, method: str) -> dict[str, Any]:
    return dict(document["paths"][path][method]["responses"])


def test_errors_are_openai_bodies_and_no_422_is_documented(document: dict[str, Any]) -> None:
    error_ref = "#/components/schemas/ErrorResponse"
    for path, operations in document["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            assert "422" not in responses
            expected = {"404", "413", "500", "503"} | (
                {"400", "401"} if path.startswith("/v1/") else set()
            )
            assert expected <= responses.keys(), path
            for status in expected:
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": error_ref}
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_completions_answer_json_or_events(document: dict[str, Any]) -> None:
    for path, model in [
        ("/v1/completions", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionResponse"),
    ]:
        content = _responses(document, path, "post")["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert content["text/event-stream"]["schema"]["required"] == ["data"]
        assert model in document["components"]["schemas"]


def test_health_and_metrics_are_not_json(document: dict[str, Any]) -> None:
    assert "content" not in _responses(document, "/health", "get")["200"]
    assert list(_responses(document, "/metrics", "get")["200"]["content"]) == ["text/plain"]
