"""Tools (function calling) over HTTP with the real model, through both pools (and the colocated
replica): forced calls follow their functions' schemas and come back as OpenAI tool_calls,
streamed the same as not (the arguments in pieces); a conversation carrying calls and their results goes on; "none" shows
no tools; requests that do not agree are 400s; every block is free after."""

import json
from types import SimpleNamespace

import jsonschema
import pytest

from router.tool_parser import merge_calls
from service_util import http, pools_all_free, sse_events

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "web_search", "description": "Search the web",
                                           "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "web_search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names=frozenset(SCHEMAS)) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_the_openai_client_gets_forced_calls_streamed_or_not(disagg, colocated):
    import openai
    for base in (disagg, colocated):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        ask = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
        out = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        whole = check_calls(choice.message.tool_calls)
        assert len(whole) == 1
        # the agent loop's next turn: the SDK's message object itself, then the tool's result
        result = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 degrees"}
        follow = client.chat.completions.create(**{**ask, "max_tokens": 8,
                                                   "messages": [*ASK, choice.message, result]})
        assert follow.usage.prompt_tokens > out.usage.prompt_tokens
        streamed = list(client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False,
                                                       stream=True))
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        assert not "".join(d.content or "" for d in deltas)
        calls = [t.model_dump(exclude_none=True) for d in deltas for t in d.tool_calls or ()]
        # the call's name first, then its arguments in pieces, as they were decoded
        assert {t["index"] for t in calls} == {0} and "id" in calls[0] and len(calls) > 2, calls
        merged = [SimpleNamespace(id=c["id"], type=c["type"], function=SimpleNamespace(**c["function"]))
                  for c in merge_calls(calls)]
        assert check_calls(merged) == whole
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        named = client.chat.completions.create(**ask, tool_choice={"type": "function",
                                                                   "function": {"name": "web_search"}})
        assert [name for name, _ in check_calls(named.choices[0].message.tool_calls)] == ["web_search"]
        sampled = client.chat.completions.create(**{**ask, "temperature": 1.0, "max_tokens": 60},
                                                 tool_choice="required", n=3, seed=5)
        assert any(choice.finish_reason == "tool_calls" for choice in sampled.choices)
        for choice in sampled.choices:          # several calls allowed (parallel_tool_calls)
            if choice.finish_reason == "tool_calls":
                assert check_calls(choice.message.tool_calls)
            else:
                assert choice.finish_reason == "length"
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})


def test_a_conversation_with_calls_and_results_goes_on(disagg):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees, sunny"}]
    body = {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    status, text = http(disagg, "/v1/chat/completions", body)
    assert status == 200, text
    message = json.loads(text)["choices"][0]["message"]
    # the streamed deltas add up to the same message, whatever the model chose to write
    status, text = http(disagg, "/v1/chat/completions", {**body, "stream": True})
    events = [e for e in sse_events(text) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = merge_calls([t for d in deltas for t in d.get("tool_calls") or ()])
    assert content == (message["content"] or "")
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls", [])]


def test_tool_choice_none_shows_no_tools(disagg):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1}
    usage = {}
    for name, extra in (("plain", {}), ("none", {"tools": TOOLS, "tool_choice": "none"}),
                        ("auto", {"tools": TOOLS})):
        status, text = http(disagg, "/v1/chat/completions", {**body, **extra})
        assert status == 200, text
        out = json.loads(text)
        assert "tool_calls" not in out["choices"][0]["message"] or name == "auto"
        usage[name] = out["usage"]["prompt_tokens"]
    # the tools' description costs prompt tokens only where they are shown
    assert usage["none"] == usage["plain"] < usage["auto"] - 100


@pytest.mark.parametrize("extra, words", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "takes no response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
      "tool_choice": "required"}, "function 'f': parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 3}, "min_tokens"),
    ({"messages": [{"role": "assistant"}]}, "needs content"),
])
def test_requests_that_do_not_agree_are_openai_errors(disagg, extra, words):
    status, text = http(disagg, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 8, **extra})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert http(disagg, "/health")[0] == 200


@pytest.fixture(scope="module")
def llama3_app(ray_serve, tiny_llama_dir, tmp_path_factory):
    """A tiny model given a template that writes calls in Llama 3's JSON syntax (tests/test_tools.py)
    by the config's `chat_template` (a file's path: the router reads the text from the config)."""
    from service_util import tiny_app
    from chat_templates import LLAMA3_TEMPLATE
    path = tmp_path_factory.mktemp("llama3-template") / "llama3.jinja"
    path.write_text(LLAMA3_TEMPLATE)
    with tiny_app(ray_serve, tiny_llama_dir, "llama3", chat_template=str(path)) as base:
        path.unlink()                   # the replicas never read it
        yield base


def test_a_llama3_template_gets_calls_in_its_syntax_through_both_pools(llama3_app):
    """The forced call is written as {"name": ..., "parameters": ...} (one, parallel or not) and
    comes back as tool_calls, streamed as not; the next turn carries it back through the template
    (the config's, in place of the model's own: /tokenize renders it)."""
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0,
            "tool_choice": "required"}
    status, text = http(llama3_app, "/v1/chat/completions", body)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    status, text = http(llama3_app, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(text) if e != "[DONE]" and e["choices"]]
    streamed = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [c["function"] for c in merge_calls(streamed)] == [call["function"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    result = {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}
    status, text = http(llama3_app, "/v1/chat/completions",
                        {**body, "tool_choice": "auto", "max_tokens": 4, "messages": [*ASK, choice["message"], result]})
    assert status == 200, text
    status, text = http(llama3_app, "/tokenize", {"messages": ASK, "tools": TOOLS})
    status, prompt = http(llama3_app, "/detokenize", {"tokens": json.loads(text)["tokens"]})
    prompt = json.loads(prompt)["prompt"]
    assert "Environment: ipython" in prompt and "<|im_start|>system" not in prompt      # not the model's own
    assert pools_all_free(llama3_app, {"prefill", "decode"})
