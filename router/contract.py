"""The API contract: the OpenAPI document that GET /openapi.json serves, for one deployment.

FastAPI writes the request half from the request models (router/openai_protocol.py,
router/chat_protocol.py, every bound on its field); `openapi_document` then adds what depends on the configuration and what
FastAPI cannot know, in this order:
  1. limits     `model` is an enum of the served name(s) or null (the served model; any
                string where adapters are loaded at run time),
                `max_tokens` (and chat's `max_completion_tokens`) has this server's
                `max_tokens_limit` as its maximum, token ids lie below the vocabulary size,
                an embedding's `dimensions` is at most the model's hidden size
  2. responses  each operation's bodies (router/openai_responses.py): JSON, for the generation
                endpoints also `text/event-stream` (each event's `data` a chunk or an error
                object, or `[DONE]`), Prometheus text for /metrics, and OpenAI's error object
                for every 4xx and 5xx the server sends (no 422: validation errors are 400s)
                (Anthropic's error object on the Messages API's routes)
  3. auth       with an API key configured, a bearer scheme or an `x-api-key` header, and a 401
                on every operation but /health
The Router builds `Served` once at start (config, tokenizer, model) and the document from it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from router.embeddings_protocol import EmbeddingList
from router.guards import OPEN_PATHS
from router.messages_output import MESSAGES_PATHS, AnthropicError, MessageEvent, MessageObject, TokenCount
from router.openai_responses import (ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Detokenized,
                                     ErrorResponse, Health, ModelList, Tokenized)
from router.responses_output import ResponseDeleted, ResponseEvent, ResponseItemList, ResponseObject
from router.score_protocol import RerankList, ScoreList

REF = "#/components/schemas/{model}"

ERRORS = {
    400: "Invalid request: a body that breaks the schema, a prompt beyond the context, a bad token id, a LoRA "
         "adapter that cannot be served, or a cancel of a response that did not run in the background.",
    401: "Missing or wrong API key.",
    404: "Unknown model (or route), no such stored response, or no such LoRA adapter loaded at run time (or "
         "`runtime_lora_updating` is off).",
    413: "Request body above `max_body_bytes`.",
    429: "Overloaded: too many requests in flight, or a pool's queue is full (see Retry-After).",
    500: "Internal error.",
    502: "A KV transfer between the pools failed.",
    503: "No ready replica, one failed while serving the request, or the response store is unavailable "
         "(see Retry-After).",
    504: "The request passed its deadline (`request_timeout_s`).",
}
GUARDED = (401, 413, 429, 500)   # any operation (router/guards.py, and a bug)
GENERATION = (400, 404, 502, 503, 504)
SCORE_PATHS = ("/v1/score", "/v1/rerank")   # prefill only, as /v1/embeddings
TOKENIZING = (400, 404)     # /tokenize, /detokenize, /v1/messages/count_tokens: no pool is involved
STORED = (404, 503)         # a stored response's routes (router/response_store.py)
STORED_PATH = "/v1/responses/{response_id}"
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")     # router/runtime_lora.py
LORA_CODES = (400, 404)
MODEL_PATH = "/v1/models/{model}"


@dataclass(frozen=True)
class Served:
    """What the document states about one deployment."""
    model_names: tuple[str, ...]
    max_tokens_limit: int
    vocab_size: int
    max_model_len: int
    api_key: bool = False
    priorities: bool = False     # scheduling_policy priority: a request's `priority` may be other than 0
    runtime_loras: bool = False  # runtime_lora_updating: adapters (model names) come and go
    hidden_size: int | None = None   # the model's: the longest embedding (/v1/embeddings' dimensions)


def openapi_document(app, served: Served, root_path: str = "") -> dict:
    """The OpenAPI 3.1 document of `app` (the router's FastAPI app) as `served` configures it."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes,
                      servers=[{"url": root_path}] if root_path else None)
    _limits(doc, served)
    _responses(doc, served)
    if served.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
        for path in OPEN_PATHS:
            for operation in doc["paths"].get(path, {}).values():
                operation["security"] = []
    return doc


# ---- 1. limits ---------------------------------------------------------------------------------
def _request_schema(doc: dict, path: str) -> dict:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def _integers(schema) -> Iterator[dict]:
    """Every integer schema inside `schema` (through anyOf and items)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            yield schema
        for value in schema.values():
            yield from _integers(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _integers(value)


def _limits(doc: dict, served: Served) -> None:
    note = (f" At most {served.max_tokens_limit} on this server (its max_tokens_limit); prompt + max_tokens "
            f"must fit the model's context of {served.max_model_len} tokens.")
    for path, fields in (("/v1/completions", ("max_tokens",)),
                         ("/v1/chat/completions", ("max_tokens", "max_completion_tokens")),
                         ("/v1/responses", ("max_output_tokens",)), ("/v1/messages", ("max_tokens",))):
        properties = _request_schema(doc, path)["properties"]
        for name in fields:
            for integer in _integers(properties[name]):
                integer["maximum"] = served.max_tokens_limit
            properties[name]["description"] = properties[name].get("description", "") + note
            if properties[name].get("default") is not None:
                properties[name]["default"] = min(properties[name]["default"], served.max_tokens_limit)
        for integer in (*_integers(properties.get("prompt")), *_integers(properties.get("stop_token_ids")),
                        *_integers(properties.get("allowed_token_ids"))):
            integer["maximum"] = served.vocab_size - 1
        if "logit_bias" in properties:
            properties["logit_bias"]["description"] += f" Token ids are below {served.vocab_size}."
        if "priority" in properties and not served.priorities:
            for integer in _integers(properties["priority"]):
                integer["minimum"] = integer["maximum"] = 0
            properties["priority"]["description"] += " This server schedules first come, first served: 0."
    if not served.runtime_loras:     # else an adapter loaded at run time is named too (an unknown name: 404)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", *SCORE_PATHS,
                     "/tokenize", "/detokenize", *MESSAGES_PATHS):
            for branch in _request_schema(doc, path)["properties"]["model"]["anyOf"]:
                if branch.get("type") == "string":
                    branch["enum"] = list(served.model_names)
        for parameter in doc["paths"][MODEL_PATH]["get"]["parameters"]:
            parameter["schema"]["enum"] = list(served.model_names)
    for path, name in (("/tokenize", "tokens"), ("/detokenize", "tokens"), ("/v1/embeddings", "input")):
        properties = _request_schema(doc, path)["properties"]
        for integer in _integers(properties.get(name)):
            integer["maximum"] = served.vocab_size - 1
    if served.hidden_size is not None:
        for integer in _integers(_request_schema(doc, "/v1/embeddings")["properties"]["dimensions"]):
            integer["maximum"] = served.hidden_size


# ---- 2. responses ------------------------------------------------------------------------------
def _json(model: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=model)}}}


def _events(chunk: str) -> dict:
    """text/event-stream: the schema of one event (OpenAPI 3.1 has no itemSchema; 3.2's is the same)."""
    if chunk in ("ResponseEvent", "MessageEvent"):   # every event's data is an event object, no [DONE]
        data = {"type": "string", "description": "An event (its `type` also the SSE event's name).",
                "contentMediaType": "application/json", "contentSchema": {"$ref": REF.format(model=chunk)}}
        return {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                 "properties": {"data": data, "event": {"type": "string"}}}}}
    data = {"type": "string", "description": "A chunk, an error object (the request failed mid-stream), or "
            "[DONE] (the last event).",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [{"$ref": REF.format(model=chunk)},
                                                 {"$ref": REF.format(model="ErrorResponse")}]}}}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                             "properties": {"data": data, "event": {"type": "string"}}}}}


def _ok(path: str, method: str) -> dict:
    if path == STORED_PATH:
        if method == "delete":
            return {"description": "The response is forgotten.", "content": _json("ResponseDeleted")}
        return {"description": "The stored response, or with `stream` a background stream's events again (after "
                "`starting_after`), live to its end.",
                "content": {**_json("ResponseObject"), **_events("ResponseEvent")}}
    if path == STORED_PATH + "/cancel":
        return {"description": "The background response, cancelled (or as it ended, where it ended before).",
                "content": _json("ResponseObject")}
    if path == STORED_PATH + "/input_items":
        return {"description": "A page of the items the model saw before the response's output.",
                "content": _json("ResponseItemList")}
    if path == "/v1/completions":
        return {"description": "The completion, or with `stream` its server-sent events.",
                "content": {**_json("Completion"), **_events("CompletionChunk")}}
    if path == "/v1/chat/completions":
        return {"description": "The chat completion, or with `stream` its server-sent events.",
                "content": {**_json("ChatCompletion"), **_events("ChatCompletionChunk")}}
    if path == "/v1/responses":
        return {"description": "The response, or with `stream` its events (router/responses_output.py).",
                "content": {**_json("ResponseObject"), **_events("ResponseEvent")}}
    if path == "/v1/embeddings":
        return {"description": "Each input's embedding.", "content": _json("EmbeddingList")}
    if path == "/v1/score":
        return {"description": "Each pair's score.", "content": _json("ScoreList")}
    if path == "/v1/rerank":
        return {"description": "The documents' scores, best first.", "content": _json("RerankList")}
    if path == "/v1/messages":
        return {"description": "The message, or with `stream` its events (router/messages_output.py).",
                "content": {**_json("MessageObject"), **_events("MessageEvent")}}
    if path == "/v1/messages/count_tokens":
        return {"description": "The prompt's tokens.", "content": _json("TokenCount")}
    if path == "/tokenize":
        return {"description": "The prompt's token ids.", "content": _json("Tokenized")}
    if path == "/detokenize":
        return {"description": "The tokens' text.", "content": _json("Detokenized")}
    if path == "/v1/models":
        return {"description": "The served model.", "content": _json("ModelList")}
    if path == MODEL_PATH:
        return {"description": "The served model.", "content": _json("ModelCard")}
    if path == "/health":
        return {"description": "Every pool has a ready replica.", "content": _json("Health")}
    if path in LORA_PATHS:
        return {"description": "Done (vLLM's text).", "content": {"text/plain": {"schema": {"type": "string"}}}}
    assert path == "/metrics", path
    return {"description": "Prometheus text exposition format 0.0.4.",
            "content": {"text/plain": {"schema": {"type": "string"}}}}


def _responses(doc: dict, served: Served) -> None:
    schemas = doc["components"]["schemas"]
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    _, defs = models_json_schema([(m, "serialization") for m in (Completion, CompletionChunk, ChatCompletion,
                                                                  ChatCompletionChunk, ModelList, Health,
                                                                  ErrorResponse, Tokenized, Detokenized,
                                                                  ResponseObject, ResponseEvent, ResponseDeleted,
                                                                  ResponseItemList, EmbeddingList, MessageObject,
                                                                  MessageEvent, TokenCount, AnthropicError,
                                                                  ScoreList, RerankList)],
                                     ref_template=REF)
    clashes = set(defs["$defs"]) & set(schemas)        # a response model named as a request's would replace it
    assert not clashes, f"request and response models share names: {sorted(clashes)}"
    schemas.update(copy.deepcopy(defs["$defs"]))
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            codes = set(GUARDED) | (set(GENERATION) if path.startswith("/v1/") and method == "post" else set())
            if path in LORA_PATHS:
                codes = set(GUARDED) | set(LORA_CODES)
            if path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens"):
                codes = set(GUARDED) | set(TOKENIZING)
            if path in ("/v1/embeddings", *SCORE_PATHS):           # no KV hand-off
                codes.discard(502)
            if path == MODEL_PATH:
                codes.add(404)
            if path.startswith(STORED_PATH):       # no pool involved
                codes = set(GUARDED) | set(STORED) | ({400} if path.endswith(("/input_items", "/cancel"))
                                                      or (path == STORED_PATH and method == "get") else set())
            if path == "/health":
                codes = (codes - {401}) | {503}
            elif not served.api_key:
                codes.discard(401)
            error = "AnthropicError" if path in MESSAGES_PATHS else "ErrorResponse"
            operation["responses"] = {"200": _ok(path, method), **{
                str(code): {"description": ERRORS[code], "content": _json(error)} for code in sorted(codes)}}
