"""The structured-output fields of an OpenAI request: OpenAI's `response_format` (json_object,
json_schema) and vLLM's `structured_outputs`, mapped to `StructuredOutputsParams`."""

from __future__ import annotations

from typing import Any, Literal

from kvstore.engine.errors import InvalidRequest
from kvstore.engine.structured_output.params import StructuredOutputsParams
from pydantic import BaseModel, ConfigDict, Field


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's {name, description, schema, strict}."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # xgrammar's schemas are strict already (no unlisted properties)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` body field. The options vLLM has and this engine does not
    (structural_tag, whitespace_pattern, ...) are a 400, never ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def structured_outputs_params(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsRequest | None
) -> StructuredOutputsParams | None:
    """The request's constraint, or None. InvalidRequest when it is contradictory or incomplete."""
    fmt = response_format if response_format is not None and response_format.type != "text" else None
    so = structured_outputs
    if fmt is not None and so is not None:
        raise InvalidRequest(
            "give either response_format or structured_outputs, not both", param="response_format"
        )
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt is not None:
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest(
                "response_format of type json_schema needs json_schema.schema", param="response_format"
            )
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)
    if so is None:
        return None
    return StructuredOutputsParams(
        json=so.json_schema, regex=so.regex, choice=so.choice, grammar=so.grammar,
        json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
    )  # fmt: skip
