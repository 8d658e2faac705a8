"""The Responses API over HTTP with the openai client, through both pools (real model): text equal
to the chat endpoint's for the same conversation, streamed as not (the SDK's own stream helper
accumulates the events into the same response), a forced function call and the next turn carrying
it back, stored responses (retrieved, chained with previous_response_id as their stateless twin,
listed, deleted), a JSON schema, max_output_tokens, refusals, a client that leaves mid-stream, and
background responses (polled to the same text; streamed, left and streamed again from where the
client left, to the same text; one cancelled mid-generation, its requests aborted; refusals
answered at once);
every block is free after."""

import json
import re
import time

import jsonschema
import pytest

from service_util import http, leave_at_first_token, metrics, pools_all_free, wait_until

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
    assert out.id.startswith("resp_") and out.output[0].type == "message" and out.store is True
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


def test_stored_responses_are_retrieved_chained_listed_and_deleted(client, disagg):
    import openai
    ask = dict(model=MODEL, max_output_tokens=16, temperature=0)
    first = client.responses.create(**ask, instructions="Answer in a few words.", input="My name is Ada. Hello!")
    assert first.store is True and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert re.search(r'^pdserve_responses_saved_total\{result="stored"\} [1-9]', http(disagg, "/metrics")[1], re.M)
    question = "What is my name?"
    chained = client.responses.create(**ask, previous_response_id=first.id, input=question)
    # its stateless twin: the first turn's input and output sent whole (no instructions: they are not carried over)
    twin = client.responses.create(**ask, store=False, input=[
        {"role": "user", "content": "My name is Ada. Hello!"}, *[i.model_dump(exclude_none=True) for i in first.output],
        {"role": "user", "content": question}])
    assert chained.previous_response_id == first.id and chained.output_text == twin.output_text
    assert chained.usage.input_tokens == twin.usage.input_tokens > first.usage.input_tokens
    assert twin.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(twin.id)
    events = list(client.responses.create(**ask, previous_response_id=first.id, input=question, stream=True))
    streamed = events[-1].response          # (response.incomplete where cut: the SDK's stream helper wants completed)
    assert streamed.output_text == chained.output_text and streamed.store is True and streamed.status == chained.status
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text  # kept before its last event
    # what the chained response's model saw, oldest first, one item a page
    items = list(client.responses.input_items.list(chained.id, order="asc", limit=1))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[0].content[0].text == "My name is Ada. Hello!" and items[2].content[0].text == question
    assert items[1].id == first.output[0].id
    newest = client.responses.input_items.list(chained.id)             # default: newest first
    assert [i.id for i in newest.data] == [i.id for i in reversed(items)] and not newest.has_more
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order")):
        code, text = http(disagg, f"/v1/responses/{chained.id}/input_items?{query}")
        assert code == 400 and json.loads(text)["error"]["param"] == param, text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="Previous response with id") as gone:
        client.responses.create(**ask, previous_response_id=first.id, input=question)
    assert gone.value.code == "previous_response_not_found" and gone.value.param == "previous_response_id"
    again = client.responses.create(**ask, previous_response_id=chained.id, input="And again?")  # its own copy
    assert again.usage.input_tokens > chained.usage.input_tokens
    code, text = http(disagg, f"/v1/responses/{first.id}", method="DELETE")
    assert code == 404 and json.loads(text)["error"]["message"] == f"Response with id {first.id!r} not found."
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_a_json_schema_text_format(client):
    out = client.responses.create(model=MODEL, input="Name a city as JSON.", max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER}})
    jsonschema.validate(json.loads(out.output_text), WEATHER)


@pytest.mark.parametrize("body, status, words", [
    ({"previous_response_id": "resp_123"}, 404, "Previous response with id 'resp_123' not found"),
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
                                  "max_output_tokens": 1500, "stream": True, "temperature": 0},   # greedy: it runs on
                         path="/v1/responses")
    assert wait_until(lambda: _aborted(disagg) == before + 1, 30)
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_background_responses_are_polled_and_cancelled(client, disagg):
    ask = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=16, temperature=0)
    expected = client.responses.create(**ask)
    queued = client.responses.create(**ask, background=True)
    assert queued.status == "queued" and queued.background and queued.output == [] and queued.store
    ended = []
    assert wait_until(lambda: ended.append(client.responses.retrieve(queued.id)) or
                      ended[-1].status not in ("queued", "in_progress"), timeout=60)
    assert ended[-1].status == expected.status and ended[-1].output_text == expected.output_text
    assert ended[-1].usage.output_tokens == expected.usage.output_tokens
    assert client.responses.cancel(queued.id).status == expected.status       # it ended before: as it ended
    code, text = http(disagg, f"/v1/responses/{expected.id}/cancel", {})
    assert code == 400 and "background" in json.loads(text)["error"]["message"]
    before = _aborted(disagg)
    # greedy: this prompt's reply runs all 2000 tokens (sampled, ~1 in 20 ended within 100 tokens, done
    # before the check below that it is still in progress)
    story = client.responses.create(model=MODEL, input="Write a very long story about a dragon, in ten chapters.",
                                    max_output_tokens=2000, background=True, temperature=0)
    # in_progress: its chat completion is called; past the router's 3 s lease (renewed), its request decodes
    assert wait_until(lambda: client.responses.retrieve(story.id).status == "in_progress", timeout=10)
    time.sleep(3.5)
    assert client.responses.retrieve(story.id).status == "in_progress"
    assert wait_until(lambda: any(v > 0 for (name, pool, _), v in metrics(disagg).items()
                                  if name == "pdserve_running_requests" and pool == "decode"), timeout=60)
    cancelled = client.responses.cancel(story.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(story.id).status == "cancelled"
    assert wait_until(lambda: _aborted(disagg) > before, timeout=10)
    assert pools_all_free(disagg, {"prefill", "decode"})
    # with stream: the client leaves after the first text, comes back from there (GET ?stream=true), and
    # the events add up to the same response
    first = []
    with client.responses.create(**ask, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break                                # the stream closes: the client leaves mid-generation
    assert [e.type for e in first[:2]] == ["response.created", "response.queued"]
    rest = list(client.responses.retrieve(first[0].response.id, stream=True,
                                          starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.output_text
    assert events[-1].type == f"response.{expected.status}" and events[-1].response.output_text == expected.output_text
    # what the chat endpoint refuses is the create call's answer, not a failed response
    code, text = http(disagg, "/v1/responses", {"model": "nope", "input": "Hi", "background": True})
    assert code == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    code, text = http(disagg, "/v1/responses", {"model": MODEL, "input": "Paris " * 9000, "background": True})
    assert code == 400 and "maximum context length" in text, text
