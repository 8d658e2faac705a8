"""The value types the request models are built from (router/openai_protocol.py,
router/chat_protocol.py, router/tools.py): strict JSON types, integers that accept integral floats, and text that any
tokenizer can take; and the JSON Schema pieces their cross-field rules are stated in."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError


MODEL_FIELD = ("The served model's name (GET /v1/models); any other is a 404. Omitted or null: the served "
               "model (as vLLM and llama.cpp's server take it).")


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(ge: int | None = None, le: int | None = None):  # noqa: N802 - a type, used in annotations
    """An integer in [ge, le]. JSON Schema's integers include 2.0, so an integral float is one too
    (strict validation takes no other float, nor "2", nor true). The bounds come before the
    conversion, so that the JSON schema states them."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (a lone surrogate escape is not)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]   # JSON can carry "\udc80"; no tokenizer takes it
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]


def TextPartType(*types: str):  # noqa: N802 - a type, used in annotations
    """A content part's `type`, one of `types` (text): any other part (an image, audio, a file) is
    refused as such, saying that the model reads text only."""
    def check(value):
        if isinstance(value, str) and value not in types:
            raise PydanticCustomError("literal_error", "Input should be {expected}: this server's model reads text "
                                      "only, not {got} parts", {"expected": " or ".join(map(repr, types)),
                                                                "got": repr(value)})
        return value
    return Annotated[Literal[types], BeforeValidator(check)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StrictOpen(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def implies(name: str, schema: dict, then: dict) -> dict:
    """JSON Schema for a model validator's "`name` matching `schema` needs `then`"."""
    return {"if": {"properties": {name: schema}, "required": [name]}, "then": then}


def present(name: str) -> dict:
    """JSON Schema: `name` is given and not null."""
    return {"properties": {name: {"not": {"type": "null"}}}, "required": [name]}


# value types of OpenAI's fields that chat and the Responses API share
REASONING_EFFORT = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
SERVICE_TIER = Literal["auto", "default", "flex", "scale", "priority"]
METADATA = Annotated[dict[Text, Text], Field(max_length=16)]      # up to 16 string pairs
