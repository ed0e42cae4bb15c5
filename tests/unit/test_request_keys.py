"""`engine_contract.keys`: the one list of request keys, as the parser, the server's request
models, the architecture's table and the README's table know them; and the one parse of a
request's keys in the API process."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from server_fakes import POLICY, build

from noisy_temp_server.engine_contract import request_args
from noisy_temp_server.engine_contract.keys import (
    API_ONLY_KEYS,
    CLIENT_KEYS,
    ENGINE_ONLY_KEYS,
    KEY_PREFIX,
    REQUEST_KEYS,
    SERVER_KEYS,
)
from noisy_temp_server.engine_contract.request_args import parse_request_args
from noisy_temp_server.server.protocol import ChatCompletionRequest, CompletionRequest
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor

_ROOT = Path(__file__).resolve().parents[2]

_VALID_VALUES: dict[str, Any] = {
    "nts_tune": True,
    "nts_rule": "sqrt",
    "nts_t": 1.2,
    "nts_t_min": 0.5,
    "nts_t_max": 2.0,
    "nts_trace": True,
    "nts_bias": False,
    "nts_policy": TemperaturePolicy.identity().to_json(),
    "nts_trace_id": "choice-0",
    "nts_capture": True,
    "nts_runtime_noise_sigma": 0.5,
    "nts_adapter": True,
}
_MODELS: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"prompt": "hi"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
}


def test_every_key_has_one_role() -> None:
    engine_client_keys = tuple(key for key in CLIENT_KEYS if key not in API_ONLY_KEYS)
    roles = (engine_client_keys, SERVER_KEYS, ENGINE_ONLY_KEYS)
    assert sum(len(keys) for keys in roles) == len(REQUEST_KEYS)
    assert set().union(*roles) == REQUEST_KEYS
    assert set(API_ONLY_KEYS) <= set(CLIENT_KEYS)
    assert all(key.startswith(KEY_PREFIX) for key in REQUEST_KEYS | set(API_ONLY_KEYS))


@pytest.mark.parametrize("key", sorted(REQUEST_KEYS))
def test_the_parser_accepts_every_key(key: str) -> None:
    parse_request_args({key: _VALID_VALUES[key]})


def test_the_parser_accepts_no_other_key() -> None:
    assert set(_VALID_VALUES) == REQUEST_KEYS | set(API_ONLY_KEYS)  # a new key needs a value
    with pytest.raises(ValueError, match="Unknown noisy-temp-server request key") as refused:
        parse_request_args({"nts_temperature": 1.0})
    assert all(key in str(refused.value) for key in REQUEST_KEYS)


@pytest.mark.parametrize("key", API_ONLY_KEYS)
def test_the_engine_refuses_a_key_of_the_api_process(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        parse_request_args({key: _VALID_VALUES[key]})


@pytest.mark.parametrize("model", list(_MODELS))
def test_each_request_model_has_a_field_per_client_key(model: type[BaseModel]) -> None:
    fields = [name for name in model.model_fields if name.startswith(KEY_PREFIX)]
    assert fields == list(CLIENT_KEYS)


def _request_args(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """The `nts_*` keys a request of `model` with `body` hands to the parser."""
    request = model.model_validate({**_MODELS[model], **body})
    return request.nts_request_args()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("model", list(_MODELS))
@pytest.mark.parametrize("key", CLIENT_KEYS)
def test_a_client_key_reaches_the_parser_both_ways(model: type[BaseModel], key: str) -> None:
    value = _VALID_VALUES[key]
    for body in ({key: value}, {"vllm_xargs": {key: value}}):
        assert _request_args(model, body) == {key: value}


@pytest.mark.parametrize("model", list(_MODELS))
@pytest.mark.parametrize("key", SERVER_KEYS + ENGINE_ONLY_KEYS)
def test_the_server_refuses_a_key_that_is_not_the_clients(model: type[BaseModel], key: str) -> None:
    value = _VALID_VALUES[key]
    for body in ({key: value}, {"vllm_xargs": {key: value}}):
        with pytest.raises((ValidationError, ValueError), match=key):
            _request_args(model, body)


def _table_keys(document: Path, heading: str) -> set[str]:
    """The ``nts_*`` keys in the first column of the table under ``heading`` of ``document``."""
    section = document.read_text(encoding="utf-8").split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`(nts_\w+)`", row.split("|")[1])}


def test_the_architecture_table_lists_exactly_the_keys() -> None:
    listed = _table_keys(_ROOT / "docs" / "architecture.md", "### Flat request keys")
    assert listed == REQUEST_KEYS | set(API_ONLY_KEYS)


def test_the_readme_table_lists_exactly_the_client_keys() -> None:
    assert _table_keys(_ROOT / "README.md", "## Using the server") == set(CLIENT_KEYS)


def test_the_api_process_parses_a_request_s_keys_once(monkeypatch: pytest.MonkeyPatch) -> None:
    server = build(Settings(), POLICY)
    parses: list[object] = []
    parse = request_args._parse
    monkeypatch.setattr(request_args, "_parse", lambda keys: parses.append(keys) or parse(keys))
    body = {"prompt": "abc", "max_tokens": 2, "n": 2, "nts_rule": "fixed", "nts_t": 1.5}
    assert server.post("/v1/completions", body).status_code == 200
    assert len(parses) == 1
    for _, params, _ in server.engine.calls:  # what vLLM's API process runs on each
        NoisyTemperatureLogitsProcessor.validate_params(params)
    assert len(parses) == 1
