"""The Responses API (router/responses_protocol.py, router/responses_output.py): a request's
input items become the chat messages they stand for, a chained request the conversation its
stateless twin sends whole, what a text server cannot do is refused, and a chat completion's stream
becomes events that add up to the non-streamed response. Over HTTP with the openai client in
tests/test_responses_service.py; the store's bookkeeping in tests/test_response_store.py."""

import json
import random

import pytest
from pydantic import ValidationError

from router.responses_output import ResponseEvents, ResponseShape, response_from_chat
from router.responses_protocol import ResponsesRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def test_a_string_input_is_one_user_message_after_the_instructions():
    chat = request(instructions="Be brief.", max_output_tokens=20, temperature=0.5).chat()
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat.max_completion_tokens == 20 and chat.temperature == 0.5 and not chat.stream


def test_items_become_the_conversation_they_stand_for():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "Call the tool."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Nice"}'},
             {"type": "function_call_output", "call_id": "call_a", "output": "18 degrees"},
             {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "20"}]},
             {"type": "function_call", "call_id": "call_c", "name": "get_weather", "arguments": "{}"}]
    messages = [m.model_dump(exclude_none=True) for m in request(input=items, tools=[TOOL]).chat().messages]
    call = lambda i, city: {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": city}}
    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "Call the tool.",
         "tool_calls": [call("call_a", '{"city": "Paris"}'), call("call_b", '{"city": "Nice"}')]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "call_b", "content": "20"},
        {"role": "assistant", "tool_calls": [call("call_c", "{}")]}]


def test_tools_tool_choice_and_text_format_become_the_chats():
    chat = request(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False).chat()
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER
    assert chat.structured().kind == "lark" and chat.parallel_tool_calls is False
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    spec = request(text={"format": fmt}).chat().structured()
    assert spec.kind == "json_schema" and json.loads(spec.value) == WEATHER
    assert request(text={"format": {"type": "json_object"}}).chat().structured().kind == "json_object"
    assert request(text={"format": {"type": "text"}}).chat().structured() is None
    stream = request(stream=True).chat()
    assert stream.stream and stream.include_usage


def test_openais_fields_that_change_nothing_are_accepted():
    ignored = {"safety_identifier": "u", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
               "service_tier": "auto"}
    assert request(**ignored).chat().model_dump() == request().chat().model_dump()
    with pytest.raises(ValidationError):
        request(prompt_cache_retention="1h")


@pytest.mark.parametrize("fields, words", [
    ({"background": True, "store": False}, "stored to be polled"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input_text"),
    ({"text": {"format": {"type": "json_schema", "schema": WEATHER}}}, "needs a name"),
    ({"tools": [{"type": "web_search"}]}, "function"),
    ({"truncation": "middle"}, "disabled"),
    ({"seed": 3}, "Extra inputs"),
    ({"input": []}, "at least 1"),
])
def test_what_a_text_server_cannot_do_is_refused(fields, words):
    with pytest.raises(ValidationError, match=words):
        request(**fields)


def test_truncation_leaves_out_the_first_items_and_the_outputs_of_calls_left_out():
    history = [{"type": "message", "role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "18"},
               {"type": "function_call_output", "call_id": "c2", "output": "19"}]
    body = request(input="And tomorrow?", tools=[TOOL])
    roles = lambda chat: [(m.role, m.tool_call_id) for m in chat.messages]
    assert body.item_count(history) == 6
    assert roles(body.chat(history, skip=1)) == [("assistant", None), ("tool", "c1"), ("tool", "c2"), ("user", None)]
    assert roles(body.chat(history, skip=2)) == [("assistant", None), ("tool", "c2"), ("user", None)]   # c1's goes
    assert roles(body.chat(history, skip=3)) == [("user", None)]
    assert roles(body.chat(history, skip=99)) == [("user", None)]          # the last item always stays
    assert request(instructions="Be brief.").chat(skip=5).messages[0].role == "system"


def test_truncation_auto_leaves_out_the_fewest_first_items_that_let_it_fit(default_model_dir):
    """Through the real template and tokenizer: the conversation the chat endpoint gets is the
    longest tail of it whose prompt fits the context with max_output_tokens."""
    import asyncio

    from fastapi.responses import JSONResponse
    from transformers import AutoTokenizer

    from router.chat_prompt import chat_prompt_ids
    from router.responses_api import ResponsesApi
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    count = lambda chat: len(chat_prompt_ids(tokenizer, chat, False))
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "word " * (20 + 7 * i)}
             for i in range(11)]
    sent = []

    async def chat(c):           # the chat endpoint's place: what it was asked is what matters here
        sent.append(c)
        return JSONResponse({})

    def create(**fields):
        body = request(**{"input": turns, "instructions": "Be brief.", "max_output_tokens": 50, **fields})
        api = ResponsesApi(None, 4096, "m", chat, lambda kept: None, prompt_tokens=count, max_model_len=limit)
        asyncio.run(api.create(body))
        return body, sent[-1]
    limit = count(request(input=turns, instructions="Be brief.").chat()) - 200
    body, got = create(truncation="auto")
    kept = len(got.messages) - 1                                       # the instructions stay
    assert got.messages[0].content == "Be brief." and got.messages[-1].content == turns[-1]["content"]
    assert 1 < kept < len(turns)
    assert count(got) + 50 <= limit < count(body.chat(skip=len(turns) - kept - 1)) + 50   # one more would not fit
    assert count(create()[1]) == limit + 200                          # disabled: all of it (the endpoint's 400)
    short, got = create(truncation="auto", input=turns[:3])            # what fits is sent whole
    assert got == short.chat()


def test_input_is_stored_as_items_in_openais_form_with_ids():
    assert [{k: v for k, v in i.items() if k != "id"} for i in request().input_items()] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}], "status": "completed"}]
    items = request(input=[
        {"role": "assistant", "content": "Sure.", "id": "msg_given"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "18"}]}]
    ).input_items()
    assert items[0] == {"type": "message", "id": "msg_given", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "Sure."}]}
    assert [i["id"][:3] for i in items[1:]] == ["rs_", "fc_", "fco"] and len({i["id"] for i in items}) == 4
    assert items[1]["summary"] == [{"type": "summary_text", "text": "Hm."}] and "content" not in items[1]
    assert items[3]["output"] == [{"type": "input_text", "text": "18"}] and items[2]["status"] == "completed"


@pytest.mark.parametrize("message, finish", MESSAGES_WITH_CALLS := [
    ({"role": "assistant", "content": "Let me check.", "reasoning": "Use the tool.",
      "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Oslo"}'}}]},
     "tool_calls"),
    ({"role": "assistant", "content": "Cut sho"}, "length"),
])
def test_a_chained_request_is_the_conversation_its_stateless_twin_sends_whole(message, finish):
    first = request(instructions="Be brief.", input="Weather in Oslo?", tools=[TOOL])
    response = response_from_chat(ResponseShape(first, "resp_1", "m", store=True),
                                  {"choices": [{"index": 0, "message": message, "finish_reason": finish}]})
    assert response["store"] is True and response["previous_response_id"] is None
    history = first.input_items() + response["output"]        # router/response_store.py Found.history
    follow = [{"type": "function_call_output", "call_id": "call_x", "output": "18 degrees"}]
    chained = request(input=follow, previous_response_id="resp_1", instructions="Be kind.", tools=[TOOL])
    twin = request(input=history + follow, instructions="Be kind.", tools=[TOOL])
    dump = lambda chat: [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dump(chained.chat(history)) == dump(twin.chat())
    assert dump(chained.chat(history))[:3] == [       # the first request's instructions are not carried over
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": message["content"], **({"reasoning": message["reasoning"]}
                                                              if "reasoning" in message else {}),
         **({"tool_calls": message["tool_calls"]} if "tool_calls" in message else {})}]
    assert ResponseShape(chained, "resp_2", "m").echo["previous_response_id"] == "resp_1"
    assert len(chained.chat(history * 600).messages) > 1024     # a stored conversation is not bound by MAX_ITEMS


def test_where_the_request_and_its_chat_disagree_the_chat_says_why():
    with pytest.raises(ValidationError, match="needs tools"):
        request(tool_choice="required").chat()


# ---- output --------------------------------------------------------------------------------------
CALL = {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
USAGE = {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 4}}
MESSAGES = [  # (chat message, finish_reason)
    ({"role": "assistant", "content": "Hello there, friend."}, "stop"),
    ({"role": "assistant", "content": "Cut sho"}, "length"),
    ({"role": "assistant", "content": "", "reasoning": "Thinking it over."}, "length"),
    ({"role": "assistant", "content": "The answer.", "reasoning": "First, think."}, "stop"),
    ({"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_y"}]}, "tool_calls"),
    ({"role": "assistant", "content": "Let me check.", "reasoning": "Use the tool.", "tool_calls": [CALL]},
     "tool_calls"),
    ({"role": "assistant", "content": ""}, "stop"),
]


def chunks(message: dict, finish: str, rng: random.Random) -> list[dict]:
    """A chat stream of `message` (as router/app.py's _sse sends it), its text cut at random."""
    def chunk(delta, finish_reason=None):
        return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    out = [chunk({"role": "assistant", "content": ""})]
    for key in ("reasoning", "content"):
        text = message.get(key) or ""
        while text:
            n = rng.randint(1, 5)
            out.append(chunk({"content": None, key: text[:n]} if key == "reasoning" else {"content": text[:n]}))
            text = text[n:]
    for i, call in enumerate(message.get("tool_calls") or []):     # its head, then its arguments in pieces
        arguments = call["function"]["arguments"]
        n = rng.randint(0, 3)
        out.append(chunk({"content": None, "tool_calls": [
            {"index": i, **call, "function": {"name": call["function"]["name"], "arguments": arguments[:n]}}]}))
        arguments = arguments[n:]
        while arguments:
            n = rng.randint(1, 5)
            out.append(chunk({"content": None, "tool_calls": [{"index": i, "function": {"arguments": arguments[:n]}}]}))
            arguments = arguments[n:]
    out.append(chunk({"content": None}, finish))
    return out + [{"choices": [], "usage": USAGE}]


def without_ids(value):
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created_at")}
    return [without_ids(v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("message, finish", MESSAGES)
def test_the_stream_adds_up_to_the_response(message, finish):
    shape = ResponseShape(request(), "resp_1", "m")
    whole = response_from_chat(shape, {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                       "usage": USAGE})
    assert whole["status"] == ("incomplete" if finish == "length" else "completed")
    assert whole["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 7,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 17}
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == (["reasoning"] * bool(message.get("reasoning"))
                     + ["message"] * bool(message.get("content") or not (message.get("reasoning")
                                                                         or message.get("tool_calls")))
                     + ["function_call"] * len(message.get("tool_calls") or []))
    for seed in range(3):
        events = ResponseEvents(shape)
        sent = events.start()
        for c in chunks(message, finish, random.Random(seed)):
            sent += events.chunk(c)
        sent += events.closing() + [events.last(events.result())]      # as router/responses_api.py ends it
        parsed = [json.loads(e.split("data: ", 1)[1]) for e in sent]
        assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
        assert all(e.startswith(f"event: {p['type']}\n") for e, p in zip(sent, parsed))
        assert [p["type"] for p in parsed[:2]] == ["response.created", "response.in_progress"]
        last = parsed[-1]
        assert last["type"] == f"response.{whole['status']}" and without_ids(last["response"]) == without_ids(whole)
        # the deltas of each item add up to its text, and each item opens and closes once, in order
        added = [p["output_index"] for p in parsed if p["type"] == "response.output_item.added"]
        done = [p for p in parsed if p["type"] == "response.output_item.done"]
        assert added == [p["output_index"] for p in done] == list(range(len(whole["output"])))
        for item, d in zip(whole["output"], done):
            assert without_ids(d["item"]) == without_ids(item)
            deltas = "".join(p["delta"] for p in parsed if p.get("output_index") == d["output_index"]
                             and p["type"].endswith(".delta"))
            expect = item["arguments"] if item["type"] == "function_call" else "".join(
                c["text"] for c in item["content"])
            assert deltas == expect


def test_a_failure_mid_stream_ends_it_with_response_failed():
    events = ResponseEvents(ResponseShape(request(), "resp_1", "m"))
    sent = events.start() + events.chunk({"choices": [{"index": 0, "delta": {"content": "Hal"},
                                                       "logprobs": None, "finish_reason": None}]})
    sent += events.chunk({"error": {"message": "a replica failed", "type": "unavailable", "param": None,
                                    "code": 503}})
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in sent]
    assert [p["type"] for p in parsed][-3:] == ["response.content_part.done", "response.output_item.done",
                                                "response.failed"]
    failed = parsed[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "unavailable", "message": "a replica failed"}
    assert failed["output"][0]["content"][0]["text"] == "Hal"
