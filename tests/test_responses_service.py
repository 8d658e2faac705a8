"""The Responses API over HTTP with the openai client, through both pools (real model): text equal
to the chat endpoint's for the same conversation, streamed as not (the SDK's own stream helper
accumulates the events into the same response), a forced function call and the next turn carrying
it back, a JSON schema, max_output_tokens, refusals, and a client that leaves mid-stream; every
block is free after."""

import json
import re

import jsonschema
import pytest

from service_util import http, leave_at_first_token, pools_all_free, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city now", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(disagg):
    import openai
    return openai.OpenAI(base_url=disagg + "/v1", api_key="unused")


def test_text_equals_the_chat_endpoints_streamed_or_not(client, disagg):
    ask = dict(model=MODEL, instructions="Answer in one sentence.", input="What is the capital of France?",
               max_output_tokens=24, temperature=0)
    out = client.responses.create(**ask)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}])
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == chat.usage.completion_tokens
    assert out.id.startswith("resp_") and out.output[0].type == "message" and out.store is False
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == out.output_text and final.usage.output_tokens == out.usage.output_tokens
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{out.status}"
    assert "response.output_text.delta" in kinds
    cut = client.responses.create(**{**ask, "max_output_tokens": 2})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2
    # streamed, it ends with response.incomplete (which the SDK's stream helper, as with OpenAI, does not take)
    events = list(client.responses.create(**{**ask, "max_output_tokens": 2}, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == cut.output_text
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_a_forced_call_then_the_next_turn_with_its_output(client, disagg):
    ask = dict(model=MODEL, input="What is the weather in Paris?", tools=[TOOL], tool_choice="required",
               parallel_tool_calls=False,
               max_output_tokens=60, temperature=0)
    out = client.responses.create(**ask)
    assert out.status == "completed"
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with client.responses.stream(**ask) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    # the agent loop's next turn: the output items as given, then the call's result
    follow = client.responses.create(model=MODEL, tools=[TOOL], max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": ask["input"]}, *[item.model_dump(exclude_none=True) for item in out.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees, sunny"}])
    assert follow.usage.input_tokens > out.usage.input_tokens and follow.status in ("completed", "incomplete")
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_a_json_schema_text_format(client):
    out = client.responses.create(model=MODEL, input="Name a city as JSON.", max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER}})
    jsonschema.validate(json.loads(out.output_text), WEATHER)


@pytest.mark.parametrize("body, status, words", [
    ({"previous_response_id": "resp_123"}, 400, "keeps no responses"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"tool_choice": "required"}, 400, "needs tools"),
    ({"model": "nope"}, 404, "does not exist"),
])
def test_refusals_are_openai_errors(disagg, body, status, words):
    code, text = http(disagg, "/v1/responses", {"model": MODEL, "input": "Hi", **body})
    assert code == status, text
    error = json.loads(text)["error"]
    assert words in error["message"], error


def _aborted(base: str) -> float:
    _, text = http(base, "/metrics")
    return float(re.search(r'^pdserve_requests_total\{outcome="aborted"\} (\S+)$', text, re.M).group(1))


def test_a_client_that_leaves_mid_stream_aborts_the_request_and_frees_its_blocks(disagg):
    before = _aborted(disagg)
    leave_at_first_token(disagg, {"model": MODEL, "input": "Write a very long story about a dragon, in ten chapters.",
                                  "max_output_tokens": 1500, "stream": True}, path="/v1/responses")
    assert wait_until(lambda: _aborted(disagg) == before + 1, 30)
    assert pools_all_free(disagg, {"prefill", "decode"})
