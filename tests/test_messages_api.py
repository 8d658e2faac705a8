"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): a request's blocks
become the chat completion's messages (calls, results and thinking in their places), the chat
answer becomes a Message and its stream the Messages events; over HTTP, with Anthropic's own
client, through both pools and the colocated replica: the same greedy text as the chat endpoint,
streamed the same as not, stop sequences, forced tool calls whose input follows the schema and a
conversation that carries them on, token counts, errors in Anthropic's format, a client that leaves
mid-stream; every block free after."""

import json

import jsonschema
import pytest
from pydantic import ValidationError

from router.messages_output import MessageEvents, MessageObject, MessageShape, message_from_chat
from router.messages_protocol import MessagesRequest
from service_util import http, leave_at_first_token, pools_all_free, sse_events

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city now", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 16, "messages": ASK, **fields})


# ---- the request ---------------------------------------------------------------------------------
def test_a_conversation_with_calls_results_and_thinking_becomes_its_chat_messages():
    chat = request(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                   messages=[*ASK, {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "A tool knows.", "signature": "s"},
                       {"type": "redacted_thinking", "data": "xyz"},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                        "input": {"city": "Paris", "unit": "celsius"}}]},
                             {"role": "user", "content": [
                                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                                     {"type": "text", "text": "18 degrees"}]},
                                 {"type": "text", "text": "And tomorrow?"}]}],
                   tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   stop_sequences=["END"], top_k=5, metadata={"user_id": "u1"},
                   thinking={"type": "disabled"}).chat()
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "reasoning": "A tool knows.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER and chat.stop == ["END"] and chat.top_k == 5
    assert chat.user == "u1" and chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.max_tokens == 16 and not chat.stream
    named = request(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, stream=True).chat()
    assert named.tool_choice.function.name == "get_weather" and named.parallel_tool_calls
    assert named.include_usage and named.continuous_usage       # message_start's usage from the first chunk
    error = request(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                            "content": "no such city", "is_error": True}]}])
    assert error.chat().messages[0].content == "Error: no such city"
    shaped = request(output_config={"effort": "low", "format": {"type": "json_schema", "schema": WEATHER}}).chat()
    assert shaped.reasoning_effort == "low" and shaped.response_format.json_schema.schema_ == WEATHER
    assert not shaped.continue_final_message and shaped.add_generation_prompt
    prefill = request(messages=[*ASK, {"role": "assistant", "content": "It is"}], cache_control={"type": "ephemeral"},
                      speed="fast", inference_geo="us").chat()
    assert prefill.continue_final_message and not prefill.add_generation_prompt


@pytest.mark.parametrize("fields, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
     "reads text only, not 'image' blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "'tool_use' blocks come in assistant turns only"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
     "'tool_result' blocks come in user turns only"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom"),
    ({"tool_choice": {"type": "tool"}}, "a name goes with type 'tool'"),
    ({"temperature": 1.5}, "less than or equal to 1"),
    ({"max_tokens": None}, "max_tokens"),
    ({"container": "c"}, "Extra inputs"),
])
def test_what_the_model_cannot_do_is_refused(fields, words):
    with pytest.raises(ValidationError) as error:
        request(**fields)
    assert words in str(error.value)


def test_a_tool_choice_that_names_no_tool_is_the_chat_requests_refusal():
    with pytest.raises(ValidationError):
        request(tools=TOOLS, tool_choice={"type": "tool", "name": "web_search"}).chat()
    with pytest.raises(ValidationError):
        request(tool_choice={"type": "any"}).chat()       # a forced call needs tools


# ---- the answer ----------------------------------------------------------------------------------
def completion(message: dict, finish: str, stop_reason=None, cached: int = 0) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def test_a_chat_completion_becomes_a_message():
    shape = MessageShape(MODEL, ["END"])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    message = message_from_chat(shape, completion({"reasoning": "Hm.", "content": None, "tool_calls": [call]},
                                                  "tool_calls", cached=16))
    MessageObject.model_validate(message)
    assert message["content"] == [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                  {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                   "input": {"city": "Oslo"}}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    assert message["usage"] == {"input_tokens": 14, "output_tokens": 7, "cache_read_input_tokens": 16,
                                "cache_creation_input_tokens": 0}
    for finish, reason, stop in (("stop", "END", ("stop_sequence", "END")), ("stop", 2, ("end_turn", None)),
                                 ("stop", None, ("end_turn", None)), ("length", None, ("max_tokens", None))):
        message = message_from_chat(shape, completion({"content": "Hi"}, finish, reason))
        assert (message["stop_reason"], message["stop_sequence"]) == stop
        assert message["content"] == [{"type": "text", "text": "Hi"}]
    assert message_from_chat(shape, completion({"content": ""}, "length"))["content"] == [{"type": "text", "text": ""}]


def chunk(delta: dict | None = None, finish=None, stop_reason=None, usage=None) -> dict:
    return {"choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                  "stop_reason": stop_reason}], "usage": usage}


def test_the_stream_adds_up_to_the_message():
    usage = {"prompt_tokens": 30, "completion_tokens": 0, "total_tokens": 30}
    events = MessageEvents(MessageShape(MODEL, None))
    sent = []
    for part in (chunk({"role": "assistant", "content": ""}, usage=usage), chunk({"reasoning": "Hm"}),
                 chunk({"reasoning": "."}), chunk({"content": "Let me look."}),
                 chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": ""}}]}),
                 chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                 chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, finish="tool_calls"),
                 chunk(usage={**usage, "completion_tokens": 9, "total_tokens": 39})):
        sent += events.chunk(part)
    sent += events.closing()
    got = [json.loads(text.split("data: ", 1)[1]) for text in sent]
    assert [e["type"] for e in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert got[0]["message"]["usage"]["input_tokens"] == 30 and got[0]["message"]["content"] == []
    assert [e["index"] for e in got if "index" in e] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert "".join(e["delta"].get("partial_json", "") for e in got if e["type"] == "content_block_delta") == \
        '{"city": "Oslo"}'
    assert got[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2]["usage"]["output_tokens"] == 9
    # nothing at all: an empty text block, as the non-streamed message has
    empty = MessageEvents(MessageShape(MODEL, None))
    kinds = [json.loads(t.split("data: ", 1)[1])["type"] for t in empty.chunk(chunk({"role": "assistant"}))
             + empty.closing()]
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    failed = MessageEvents(MessageShape(MODEL, None))
    error = failed.chunk({"error": {"message": "no KV blocks", "type": "server_error", "param": None, "code": 503}})
    assert failed.failed and json.loads(error[0].split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "no KV blocks"}}


# ---- over HTTP, Anthropic's client ---------------------------------------------------------------
@pytest.mark.slow
def test_the_anthropic_client_gets_the_chat_endpoints_text_streamed_or_not(disagg, colocated):
    import anthropic
    import openai
    for base in (disagg, colocated):
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        # temperature is no longer among the client's parameters (Anthropic's 2.x SDK): sent as an extra
        ask = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0}, system="You are terse.",
                   messages=[{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                                          {"type": "text", "text": " colors."}]}])
        message = client.messages.create(**ask)
        chat = openai.OpenAI(base_url=base + "/v1", api_key="unused").chat.completions.create(
            model=MODEL, max_tokens=24, temperature=0, messages=[
                {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}])
        text = chat.choices[0].message.content
        assert [b.type for b in message.content] == ["text"] and message.content[0].text == text and text
        assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
        assert message.usage.output_tokens == chat.usage.completion_tokens
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        counted = client.messages.count_tokens(model=MODEL, system=ask["system"], messages=ask["messages"])
        assert counted.input_tokens == chat.usage.prompt_tokens
        with client.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()
        assert [(b.type, b.text) for b in streamed.content] == [("text", text)]
        assert streamed.stop_reason == message.stop_reason
        assert streamed.usage.output_tokens == message.usage.output_tokens
        assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        # a stop sequence from inside the reply: the text before it, and which one it was
        word = text.split()[1]
        stopped = client.messages.create(**ask, stop_sequences=["zzz", word])
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
        assert stopped.content[0].text == text[:text.index(word)]
        # a prefill: the assistant's last words are continued, as the chat endpoint's continue_final_message
        prefill = [*ask["messages"], {"role": "assistant", "content": "Red,"}]
        continued = client.messages.create(**{**ask, "messages": prefill})
        same = openai.OpenAI(base_url=base + "/v1", api_key="unused").chat.completions.create(
            model=MODEL, max_tokens=24, temperature=0, messages=[
                {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."},
                {"role": "assistant", "content": "Red,"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
        assert continued.content[0].text == same.choices[0].message.content
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})


@pytest.mark.slow
def test_forced_tool_calls_follow_the_schema_and_the_conversation_goes_on(disagg, colocated):
    import anthropic
    for base in (disagg, colocated):
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, max_tokens=120, extra_body={"temperature": 0}, messages=ASK, tools=TOOLS,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
        message = client.messages.create(**ask)
        assert message.stop_reason == "tool_use", message
        calls = [b for b in message.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(calls[0].input, WEATHER)
        with client.messages.stream(**ask) as stream:      # the input in pieces, the same call
            deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta"]
            streamed = stream.get_final_message()
        assert len(deltas) > 1 and json.loads("".join(deltas)) == calls[0].input
        assert [b.input for b in streamed.content if b.type == "tool_use"] == [calls[0].input]
        follow = client.messages.create(**{**ask, "max_tokens": 8, "tool_choice": {"type": "auto"}, "messages": [
            *ASK, {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": "18 degrees"}]}]})
        assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
            message.usage.input_tokens + message.usage.cache_read_input_tokens
        shaped = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, extra_body={"temperature": 0},
                                        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
        jsonschema.validate(json.loads(shaped.content[0].text), WEATHER)
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})


@pytest.mark.slow
def test_errors_are_anthropics_and_a_client_that_leaves_frees_its_blocks(disagg):
    import anthropic
    client = anthropic.Anthropic(base_url=disagg, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert error.value.body["error"]["type"] == "not_found_error" and "nope" in error.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ASK)
    for body, words in (({"model": MODEL, "messages": ASK}, "max_tokens"),
                        ({"model": MODEL, "max_tokens": 10**6, "messages": ASK}, "limit"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                         "data": "iVBO"}}]}]}, "text only"),
                        ({"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": TOOLS,
                          "tool_choice": {"type": "tool", "name": "web_search"}}, "web_search")):
        status, text = http(disagg, "/v1/messages", body)
        answer = json.loads(text)
        assert status == 400 and answer["type"] == "error", (status, text)
        assert answer["error"]["type"] == "invalid_request_error" and words in answer["error"]["message"], text
    status, text = http(disagg, "/v1/messages", raw=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 400 and json.loads(text)["type"] == "error", text
    # the stream's first events, then the client is gone: its request is aborted in the pools
    leave_at_first_token(disagg, {"model": MODEL, "max_tokens": 400, "messages": ASK, "stream": True},
                         path="/v1/messages")
    assert pools_all_free(disagg, {"prefill", "decode"})
    status, text = http(disagg, "/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": ASK, "stream": True})
    events = sse_events(text)
    assert status == 200 and events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
