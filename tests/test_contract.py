"""The OpenAPI document without a deployment (router/contract.py over the router's FastAPI app):
what it declares for each operation, and how it follows the configuration."""

import json

import jsonschema
import pytest

from router.app import app
from router.chat_protocol import ChatCompletionRequest
from router.contract import ERRORS, Served, openapi_document
from router.messages_protocol import MessagesRequest
from router.openai_protocol import CompletionRequest
from router.responses_protocol import ResponsesRequest
from serving.config import AppConfig

VOCAB, CONTEXT, HIDDEN = 49152, 2048, 576


def document(**config) -> dict:
    cfg = AppConfig(**config)
    return openapi_document(app, Served((*cfg.model_names, *cfg.lora_modules), cfg.max_tokens_limit, VOCAB, CONTEXT,
                                        api_key=bool(cfg.api_key), priorities=cfg.scheduling_policy == "priority",
                                        hidden_size=HIDDEN))


def requests(doc: dict) -> tuple[dict, dict]:
    schemas = doc["components"]["schemas"]
    return schemas["CompletionRequest"], schemas["ChatCompletionRequest"]


def test_model_enum_and_limits_follow_the_config():
    for config, names, limit in (({}, ["SmolLM2-135M-Instruct"], 4096),
                                 ({"served_model_name": "m", "max_tokens_limit": 8}, ["m"], 8),
                                 ({"served_model_name": ["m", "gpt-x"], "max_tokens_limit": 8}, ["m", "gpt-x"], 8)):
        doc = document(**config)
        completion, chat = requests(doc)
        for request in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "TokenizeRequest",
                        "DetokenizeRequest", "EmbeddingRequest"):  # the served name, or omitted / null: the model
            schema = doc["components"]["schemas"][request]
            assert schema["properties"]["model"]["anyOf"] == [{"type": "string", "enum": names}, {"type": "null"}]
            assert "model" not in schema.get("required", [])
        for schema, field in ((completion, "max_tokens"), (chat, "max_tokens"), (chat, "max_completion_tokens")):
            integer = next(s for s in schema["properties"][field]["anyOf"] if s["type"] == "integer")
            assert integer["maximum"] == limit
        assert completion["properties"]["max_tokens"]["default"] == min(16, limit)
        tokens = json.dumps(completion["properties"]["prompt"])
        assert tokens.count(f'"maximum": {VOCAB - 1}') == 2     # a token list, and a batch of them
        embedding = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]
        assert json.dumps(embedding["input"]).count(f'"maximum": {VOCAB - 1}') == 2
        assert next(s for s in embedding["dimensions"]["anyOf"] if s["type"] == "integer")["maximum"] == HIDDEN


def test_model_is_any_string_where_adapters_are_loaded_at_run_time():
    doc = openapi_document(app, Served(("m",), 8, VOCAB, CONTEXT, runtime_loras=True))
    for request in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest"):
        assert doc["components"]["schemas"][request]["properties"]["model"]["anyOf"] == [{"type": "string"},
                                                                                       {"type": "null"}]
    assert "enum" not in doc["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["schema"]
    load = doc["components"]["schemas"]["LoadLoraAdapterRequest"]
    assert set(load["required"]) == {"lora_name", "lora_path"} and load["additionalProperties"] is False


def test_priority_is_zero_unless_the_server_schedules_by_priority():
    for policy, bounds in (("fcfs", (0, 0)), ("priority", (-2**31, 2**31 - 1))):
        for schema in requests(document(scheduling_policy=policy)):
            priority = schema["properties"]["priority"]
            assert (priority["minimum"], priority["maximum"]) == bounds and priority["default"] == 0


def test_every_operation_declares_its_bodies_and_every_error_status():
    doc = document()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "422" not in responses and "401" not in responses
            error = "AnthropicError" if path.startswith("/v1/messages") else "ErrorResponse"
            for code, response in responses.items():
                if code != "200":
                    assert int(code) in ERRORS
                    assert response["content"] == {"application/json": {"schema": {
                        "$ref": f"#/components/schemas/{error}"}}}
            if path == "/v1/responses/{response_id}/cancel":
                assert set(responses) == {"200", "400", "404", "413", "429", "500", "503"}
            elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):     # no pool involved
                assert set(responses) == {"200", "400", "404", "413", "429", "500"}
                assert set(responses["200"]["content"]) == {"text/plain"}
            elif path in ("/v1/embeddings", "/v1/score", "/v1/rerank"):    # the prefill pool alone: no hand-off
                assert set(responses) == {"200", "400", "404", "413", "429", "500", "503", "504"}
                assert set(responses["200"]["content"]) == {"application/json"}
            elif method == "post" and path.startswith("/v1/") and path != "/v1/messages/count_tokens":
                assert {"400", "404", "413", "429", "500", "502", "503", "504"} <= set(responses)
                assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
            elif method == "post":       # /tokenize, /detokenize, /v1/messages/count_tokens: no pool involved
                assert set(responses) == {"200", "400", "404", "413", "429", "500"}
                assert set(responses["200"]["content"]) == {"application/json"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    card = doc["paths"]["/v1/models/{model}"]["get"]
    assert set(card["responses"]) == {"200", "404", "413", "429", "500"}
    assert card["parameters"][0]["schema"]["enum"] == ["SmolLM2-135M-Instruct"]
    stored = doc["paths"]["/v1/responses/{response_id}"]
    for method, model in (("get", "ResponseObject"), ("delete", "ResponseDeleted")):
        # a GET with stream: 400 for a response whose events are not kept, or a bad starting_after
        assert set(stored[method]["responses"]) == {"200", "404", "413", "429", "500", "503"} | (
            {"400"} if method == "get" else set())
        assert stored[method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
    assert set(stored["get"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {p["name"] for p in stored["get"]["parameters"]} == {"response_id", "stream", "starting_after"}
    items = doc["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert set(items["responses"]) == {"200", "400", "404", "413", "429", "500", "503"}
    assert {p["name"] for p in items["parameters"]} == {"response_id", "limit", "order", "after"}


def test_an_api_key_adds_the_security_schemes_and_401_everywhere_but_health():
    doc = document(api_key="k")
    assert doc["components"]["securitySchemes"] == {   # either: a bearer token, or Anthropic clients' header
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    assert doc["security"] == [{"bearer": []}, {"apiKey": []}]
    assert doc["paths"]["/health"]["get"]["security"] == [] and "401" not in doc["paths"]["/health"]["get"]["responses"]
    assert all("401" in item[m]["responses"] for path, item in doc["paths"].items() if path != "/health" for m in item)


def _valid(schema: dict, doc: dict, body: dict) -> bool:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).is_valid(body)


@pytest.mark.parametrize("model,body", [
    (CompletionRequest, {"prompt": ["a"] * 9, "n": 2}),
    (CompletionRequest, {"prompt": [[1], [2]], "n": 9}),
    (CompletionRequest, {"prompt": list(range(100)), "n": 16}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0, "echo": True}),
    (CompletionRequest, {"prompt": [1.0, 2], "n": 2.0}),
    (CompletionRequest, {"prompt": "x", "n": True}),
    (CompletionRequest, {"prompt": "x", "max_tokens": "4"}),
    (CompletionRequest, {"prompt": "x", "stop": ["a"] * 17}),
    (CompletionRequest, {"prompt": "x", "seed": 2**64}),
    (CompletionRequest, {"prompt": "x", "seed": -1}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "logprobs": True}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": None, "logprobs": None}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000,
                             "max_completion_tokens": 2}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema"}}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": None}}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_object"}, "structured_outputs": {"regex": "a"}}),
    (CompletionRequest, {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": None}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": None}}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {}}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"json": {"type": "object"}}}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"12": -100, "7": 2.5}}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"12": -101}}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"x": 1}}),
])
def test_the_request_schemas_accept_what_the_validator_accepts(model, body):
    """Including the rules that span fields (if/then in the document)."""
    doc = document(served_model_name="m", max_tokens_limit=4096)
    body = {"model": "m", **body}
    try:
        model.model_validate(body)
        accepted = max(body.get("max_tokens") or 0, body.get("max_completion_tokens") or 0) <= 4096  # the router's
    except ValueError:
        accepted = False
    schema = doc["components"]["schemas"][model.__name__]
    assert _valid(schema, doc, body) == accepted


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize("body", [
    {"input": "x", "previous_response_id": "resp_1"},
    {"input": "x", "previous_response_id": None},
    {"input": "x", "background": True},
    {"input": "x", "background": True, "stream": True},
    {"input": "x", "background": True, "store": False},
    {"input": "x", "background": True, "store": True, "stream": False},
    {"input": "x", "background": False, "stream": True},
    {"input": "x", "tool_choice": "required"},
    {"input": "x", "tool_choice": "required", "tools": []},
    {"input": "x", "tool_choice": "required", "tools": [TOOL]},
    {"input": "x", "tool_choice": "auto", "tools": []},
    {"input": "x", "tool_choice": "required", "tools": [TOOL], "text": {"format": {"type": "json_object"}}},
    {"input": "x", "tool_choice": "required", "tools": [TOOL], "text": {"format": {"type": "text"}}},
    {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
    {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": "18"}]},
    {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
    {"input": "x", "max_output_tokens": 5000},
])
def test_the_responses_schema_accepts_what_the_validator_accepts(body):
    doc = document(served_model_name="m", max_tokens_limit=4096)
    body = {"model": "m", **body}
    try:
        ResponsesRequest.model_validate(body).chat()
        accepted = (body.get("max_output_tokens") or 0) <= 4096
    except ValueError:
        accepted = False
    assert _valid(doc["components"]["schemas"]["ResponsesRequest"], doc, body) == accepted


ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
FORMAT = {"format": {"type": "json_schema", "schema": {"type": "object"}}}


@pytest.mark.parametrize("extra", [
    {"tool_choice": None},
    {"tool_choice": None, "tools": []},
    {"tool_choice": {"type": "auto"}},
    {"tool_choice": {"type": "none"}, "output_config": FORMAT},
    {"tool_choice": {"type": "any"}},
    {"tool_choice": {"type": "any"}, "tools": []},
    {"tool_choice": {"type": "any"}, "tools": [ANTHROPIC_TOOL]},
    {"tool_choice": {"type": "tool", "name": "f"}, "tools": [ANTHROPIC_TOOL]},
    {"tool_choice": {"type": "tool"}, "tools": [ANTHROPIC_TOOL]},
    {"tool_choice": {"type": "any"}, "tools": [ANTHROPIC_TOOL], "output_config": FORMAT},
    {"tool_choice": {"type": "any"}, "tools": [ANTHROPIC_TOOL], "output_config": {"effort": "low"}},
])
def test_the_messages_schema_accepts_what_the_validator_accepts(extra):
    doc = document(served_model_name="m", max_tokens_limit=4096)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **extra}
    try:
        MessagesRequest.model_validate(body).chat()
        accepted = True
    except ValueError:
        accepted = False
    assert _valid(doc["components"]["schemas"]["MessagesRequest"], doc, body) == accepted
