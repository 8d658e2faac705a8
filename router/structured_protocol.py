"""The structured-output request fields: OpenAI's `response_format` and vLLM's
`structured_outputs` (both endpoints; at most one of them a request), each mapped to the engine's
`StructuredOutput` (engine/structured_output.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from engine.structured_output import StructuredOutput, without_annotations
from router.protocol_types import NonEmptyText, Strict, StrictOpen, Text, implies

STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


class JsonSchemaFormat(StrictOpen):
    """OpenAI's `response_format.json_schema`; other keys are ignored."""
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output is a value "
                                           "of; none: any JSON object.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(StrictOpen):
    """Plain text, any JSON object, or a value of a JSON schema (`json_schema` required then);
    other keys are ignored."""
    model_config = ConfigDict(json_schema_extra=implies("type", {"const": "json_schema"}, {
        "properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]}))
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_schema" and self.json_schema.schema_ is not None:
            return StructuredOutput("json_schema", json.dumps(without_annotations(self.json_schema.schema_)))
        return None if self.type == "text" else StructuredOutput("json_object")


class StructuredOutputs(Strict):
    """vLLM's: exactly one of a JSON schema, any JSON object, a regex, a list of choices, or a
    Lark grammar."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"properties": {key: {"not": {"type": "null"}}}, "required": [key]} for key in STRUCTURED_KEYS]})
    json_: dict[str, Any] | None = Field(None, alias="json", description="A JSON schema.")
    json_object: Literal[True] | None = None
    regex: NonEmptyText | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=256)] | None = None
    grammar: NonEmptyText | None = Field(None, description="A Lark grammar (llguidance's dialect).")

    @model_validator(mode="after")
    def _exactly_one(self):
        if sum(v is not None for v in (self.json_, self.json_object, self.regex, self.choice, self.grammar)) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}")
        return self

    def structured(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput("json_schema", json.dumps(without_annotations(self.json_)))
        if self.json_object:
            return StructuredOutput("json_object")
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        return StructuredOutput("lark", self.grammar)
