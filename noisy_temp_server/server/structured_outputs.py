"""Structured outputs as vLLM's OpenAI server takes them: `response_format` (OpenAI's
`json_object` and `json_schema`, `text`) and vLLM's `structured_outputs` (exactly one of
`json`, `regex`, `choice`, `grammar`, `json_object`), on both generation endpoints.

Both become one vLLM `StructuredOutputsParams` the way vLLM's server builds it
(`structured_outputs_from_response_format`): a `response_format` other than `text` overrides
the constraint of `structured_outputs` and keeps its options (`disable_any_whitespace`...).
The engine then masks every token the grammar does not allow before the logits processors run,
so T* and the per-token bias only reshape the allowed tokens; such requests are never sampled
by the shadow scorer (`engine_contract.request_args.capturable`): their rows are the grammar's,
not the model's. An empty choice list, an empty grammar or an invalid schema, regex or grammar
are refused by vLLM's own validation (HTTP 400), as by vLLM's server.

vLLM's `structural_tag` formats are not taken (a 400: not one of the formats listed).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

__all__ = ["JsonSchemaFormat", "ResponseFormat", "StructuredOutputs", "structured_outputs_params"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: OpenAI's named JSON schema (`schema` on the wire)."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (a JSON document valid under `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one constraint and its options (vLLM's
    `StructuredOutputsParams`, whose checks apply)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = None


def structured_outputs_params(
    structured: StructuredOutputs | None, response_format: ResponseFormat | None
) -> StructuredOutputsParams | None:
    """vLLM's parameters for the request's constraint (None: none), `response_format` over
    `structured_outputs` as in vLLM's server. Raises ValueError with vLLM's message when the
    combination is invalid (none or more than one constraint, `json_schema` without a schema)."""
    overrides: dict[str, Any] = {}
    if response_format is not None and response_format.type == "json_object":
        overrides = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ValueError(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided."
            )
        overrides = {"json": response_format.json_schema.json_schema}
    try:
        if structured is None:
            return StructuredOutputsParams(**overrides) if overrides else None
        fields = structured.model_dump(by_alias=True)
        params = StructuredOutputsParams(**fields)
        return dataclasses.replace(params, **overrides) if overrides else params
    except VLLMValidationError as error:
        raise ValueError(str(error)) from None
