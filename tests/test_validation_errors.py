"""A bad request's 400 names the field and what it should be, never pydantic's union member names
(router/validation_errors.py), for the router's real request models."""

import pytest
from pydantic import ValidationError

from router.chat_protocol import ChatCompletionRequest
from router.openai_protocol import CompletionRequest
from router.responses_protocol import ResponsesRequest
from router.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from router.validation_errors import _router_models, describe

GOOD = {CompletionRequest: {"model": "m", "prompt": "x"},
        ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        ResponsesRequest: {"model": "m", "input": "x"},
        TokenizeRequest: {"prompt": "x"}, DetokenizeRequest: {"tokens": [1]}}
WRONG = [123, "x", True, [{}], {"a": 1}, [1, "a"], [[1], "a"], [[]], {"type": "zzz"}, [{"type": "zzz"}],
         [{"role": "user", "content": [{"type": "image_url"}]}], [{"type": "function_call_output", "call_id": 3}]]


def _describe(cls, body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return describe(info.value.errors())


@pytest.mark.parametrize("cls,body,message,param", [
    (CompletionRequest, {"model": "m", "prompt": 123}, "prompt: Input should be a valid string or a valid list",
     "prompt"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": 5}, "stop: Input should be a valid string or a valid list",
     "stop"),
    (CompletionRequest, {"model": "m", "prompt": ["a", [1, 2]]}, "prompt.1: Input should be a valid string",
     "prompt.1"),
    # a model validator's own words, without pydantic's "Value error, "
    (CompletionRequest, {"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True},
     "body: prompt_logprobs are not available when stream is true", None),
    (ChatCompletionRequest, {**GOOD[ChatCompletionRequest], "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type: Input should be 'text': this server's model reads text only, not 'image_url' parts; "
     "messages.0.content.0.text: Field required", "messages.0.content.0.type"),
    # a message item without its (optional) type: the message speaks, not an item type it lacks fields of
    (ResponsesRequest, {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type: Input should be 'input_text' or 'output_text': this server's model reads text only, "
     "not 'input_image' parts; input.0.content.0.text: Field required", "input.0.content.0.type"),
    (ChatCompletionRequest, {**GOOD[ChatCompletionRequest], "tool_choice": "sometimes"},
     "tool_choice: Input should be 'none', 'auto' or 'required' or an object", "tool_choice"),
    (ChatCompletionRequest, {**GOOD[ChatCompletionRequest], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name: Field required", "tool_choice.function.name"),
    # the input item whose type matched speaks, though another item type has fewer errors
    (ResponsesRequest, {"model": "m", "input": [{"type": "function_call_output", "call_id": 3}]},
     "input.0.call_id: Input should be a valid string; input.0.output: Field required", "input.0.call_id"),
    (ResponsesRequest, {"model": "m", "input": [{"type": "message", "role": "user", "content": 5}]},
     "input.0.content: Input should be a valid string or a valid list", "input.0.content"),
    (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": "ten"}, "max_tokens: Input should be a valid integer",
     "max_tokens"),
])
def test_union_failures_read_as_the_field_and_the_closest_member(cls, body, message, param):
    assert _describe(cls, body) == (message, param)


def test_no_field_of_any_request_model_shows_a_union_member_name():
    members = _router_models()
    assert {"TextPart", "NamedToolChoice", "MessageItem"} <= members
    seen = 0
    for cls, good in GOOD.items():
        for field in cls.model_fields:
            for wrong in WRONG:
                try:
                    cls.model_validate({**good, field: wrong})
                    continue
                except ValidationError as exc:
                    message, param = describe(exc.errors())
                seen += 1
                for text in (message, param or ""):
                    parts = {p for shown in text.split("; ") for p in shown.split(":")[0].split(".")}
                    assert not parts & members and not any("[" in p and p != "[key]" for p in parts), (cls, field,
                                                                                                     text)
                    assert "function-after" not in text and "constrained-" not in text, text
    assert seen > 300


def test_fastapi_location_prefix_is_skipped_and_an_empty_list_says_so():
    assert describe([{"loc": ("body", "n"), "msg": "Input should be greater than 0", "type": "greater_than"}],
                    skip=1) == ("n: Input should be greater than 0", "n")
    assert describe([{"loc": ("body",), "msg": "Field required", "type": "missing"}], skip=1) == (
        "body: Field required", None)
    assert describe([]) == ("invalid request", None)
