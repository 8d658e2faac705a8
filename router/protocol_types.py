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
MAX_REQUEST_ID = 256
REQUEST_ID_FIELD = ("vLLM's: the response's id is the endpoint's prefix (`cmpl-`, `chatcmpl-`) and this; else "
                    "the request's X-Request-Id (the client's header, or the id Serve's proxy gives each request "
                    "and logs). The pools' own request ids stay unique either way.")
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID), AfterValidator(_unicode)]


def reply_id(prefix: str, headers, request_id: str | None) -> str | None:
    """The id an answer carries (REQUEST_ID_FIELD): `<prefix>-` and the request's `request_id`, else
    its X-Request-Id header (1 to MAX_REQUEST_ID characters); else None. vLLM takes the header
    first; here Serve's proxy sets it on every request (the client's, or a new id it logs), so the
    body's field, which only a client sets, comes first. `headers`: case-insensitive, as Starlette's."""
    if request_id:
        return f"{prefix}-{request_id}"
    header = headers.get("x-request-id")
    return f"{prefix}-{header}" if header and len(header) <= MAX_REQUEST_ID else None


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
REASONING_EFFORT = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
SERVICE_TIER = Literal["auto", "default", "flex", "scale", "priority"]
METADATA = Annotated[dict[Text, Text], Field(max_length=16)]      # up to 16 string pairs
