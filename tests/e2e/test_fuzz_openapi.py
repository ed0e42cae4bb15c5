"""Fuzzing: schemathesis generates requests from the server's own /openapi.json (valid and
invalid bodies, a bounded number per operation) against the tiny model on real vLLM. No
response is a 5xx, and every one conforms to the document: a documented status code and
content type, and a body that matches its schema (server-sent events included, event by
event).

Not checked: whether every schema-valid request is accepted (`positive_data_acceptance`).
The document lists OpenAI's fields, some of which this server refuses with a 400 by design
(`suffix`, `best_of` != n, non-text content parts: see `server.protocol`;
a structured-output constraint its grammar compiler refuses, as vLLM's server does).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import stop
from tiny_serve import TinyServer, start_tiny_server

pytestmark = pytest.mark.vllm

EXAMPLES_PER_OPERATION = 25
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    # A short context keeps every generated request (n up to 128) quick on the CPU.
    server = start_tiny_server(
        tiny_model_dir, tmp_path_factory.mktemp("fuzz"), "--max-model-len", "48"
    )
    yield server
    stop(server.process)


OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/nts/status"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
]


@pytest.fixture(scope="module")
def api_schema(server: TinyServer) -> Any:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_the_fuzzed_operations_are_all_the_operations(api_schema: Any) -> None:
    documented = {
        (result.ok().method.upper(), result.ok().path) for result in api_schema.get_all_operations()
    }
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_response_is_documented_and_none_is_a_5xx(
    api_schema: Any, server: TinyServer, method: str, path: str
) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def fuzz(case: Any) -> None:
        case.call_and_validate(headers=server.headers, checks=CHECKS, timeout=120)

    fuzz()
