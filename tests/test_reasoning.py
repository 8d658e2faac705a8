"""Reasoning apart from content (router/reasoning.py, router/chat_output.py): where it starts, the
parser fed in any pieces adding up to the whole output, with tool calls after it, and over HTTP
through both pools with a template that leaves <think> open (a tiny model whose vocabulary has the
tags as single tokens, nudged to close the block; a response_format schema holds after it), and
as the Responses API's reasoning item and Anthropic's thinking block."""

import json
import random

import pytest
from transformers import AutoTokenizer

from router.chat_output import ChatOutputShape, Piece
from router.chat_protocol import ChatCompletionRequest
from router.reasoning import ReasoningStream, reasoning_template, starts_inside
from router.tools import HERMES
from service_util import http, pools_all_free, sse_events, tiny_app

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
CASES = [   # (starts inside, output, reasoning, content)
    (False, "<think>\nFirst, plan.\n</think>\n\nThe answer.", "\nFirst, plan.\n", "The answer."),
    (False, "  \n<think>plan</think>answer", "plan", "answer"),
    (False, "No thinking here, only <think> in the middle.", "", "No thinking here, only <think> in the middle."),
    (False, "\n\nLeading blank lines stay.\n", "", "\n\nLeading blank lines stay.\n"),
    (False, "<thin", "", "<thin"),                                   # a tag's start that never completed
    (False, "<think>cut short inside </thi", "cut short inside </thi", ""),
    (False, "<think>a</think>", "a", ""),
    (True, "Plan it.</think>\n\nDone.", "Plan it.", "Done."),
    (True, "only reasoning, cut by max_tokens", "only reasoning, cut by max_tokens", ""),
    (True, "</think>right away", "", "right away"),
]


def feed_in_pieces(stream, text: str, rng: random.Random, step: int):
    out, at = [], 0
    while at < len(text):
        n = step or rng.randint(1, 7)
        out.append(stream.feed(text[at:at + n]))
        at += n
    out.append(stream.finish())
    return out


@pytest.mark.parametrize("inside, text, reasoning, content", CASES)
def test_reasoning_and_content_whether_fed_whole_or_in_pieces(inside, text, reasoning, content):
    rng = random.Random(0)
    for step in (len(text) or 1, 1, 0):
        pieces = feed_in_pieces(ReasoningStream(inside), text, rng, step)
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content)


def test_a_tool_call_after_the_reasoning_and_include_reasoning():
    text = "<think>The user wants f.</think>\n\n" + CALL
    output = ChatOutputShape(tools=HERMES, reasoning=False).choice()
    reasoning, content, calls = output.message(text)
    assert reasoning == "The user wants f." and content is None
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"
    # streamed in pieces: the same reasoning, content and calls
    stream = ChatOutputShape(tools=HERMES, reasoning=False).choice()
    rng, at, got = random.Random(1), 0, Piece()
    while at < len(text):
        n = rng.randint(1, 5)
        got += stream.feed(text[at:at + n])
        at += n
    got += stream.finish()
    assert got.reasoning == reasoning and got.content == "" and [c["function"] for c in got.calls] == \
        [c["function"] for c in calls]
    dropped = ChatOutputShape(reasoning=False, include_reasoning=False).choice()
    assert dropped.message("<think>hidden</think>shown") == (None, "shown", None)
    assert ChatOutputShape(reasoning=False).choice().message("plain") == (None, "plain", None)


def test_where_the_reasoning_starts_is_read_from_the_prompt(default_model_dir):
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")    # enable_thinking false
    assert not starts_inside("<|im_start|>assistant\n")
    assert not reasoning_template(AutoTokenizer.from_pretrained(default_model_dir))


def test_a_turns_reasoning_reaches_the_template_as_reasoning_content():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning": "greet back"},
        {"role": "assistant", "content": "again", "reasoning_content": "older name"},
        {"role": "user", "content": "bye"}]})
    for native in (HERMES, None):
        conversation, _ = body.conversation(native)
        assert [m.get("reasoning_content") for m in conversation][1:3] == ["greet back", "older name"]


@pytest.fixture(scope="module")
def thinking_app(ray_serve, thinking_model_dir):
    """The tiny model with <think> and </think> as single tokens and a template whose generation
    prompt opens <think> (as DeepSeek-R1's)."""
    with tiny_app(ray_serve, thinking_model_dir, "think") as base:
        yield base


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


@pytest.mark.slow
def test_reasoning_comes_back_apart_and_the_schema_holds_after_it_through_both_pools(thinking_app,
                                                                                    thinking_model_dir):
    """response_format applies after the reasoning (engine ThinkFirst): four sampled choices, the
    model nudged to close its block (logit_bias on </think>); each closed one's content is a value
    of the schema, its reasoning free text; one cut short is all reasoning."""
    close = AutoTokenizer.from_pretrained(thinking_model_dir).convert_tokens_to_ids("</think>")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 40,
            "temperature": 1.0, "seed": 5, "n": 4, "logit_bias": {str(close): 7},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    status, text = http(thinking_app, "/v1/chat/completions", body)
    assert status == 200, text
    choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    kinds = set()
    for choice in choices:
        message = choice["message"]
        if choice["finish_reason"] == "stop":
            assert json.loads(message["content"])["tag"] in ("red", "green"), message
            assert "think>" not in (message.get("reasoning") or "")
            kinds.add("answered after thinking" if message.get("reasoning") else "answered")
        else:
            assert choice["finish_reason"] == "length" and not message["content"] and message["reasoning"]
            kinds.add("cut while thinking")
    assert "answered after thinking" in kinds and len(kinds) > 1, choices
    status, text = http(thinking_app, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0] for e in sse_events(text) if e != "[DONE]" and e["choices"]]
    for choice in choices:
        mine = [d["delta"] for d in deltas if d["index"] == choice["index"]]
        assert "".join(d.get("reasoning") or "" for d in mine) == (choice["message"].get("reasoning") or "")
        assert "".join(d.get("content") or "" for d in mine) == (choice["message"]["content"] or "")
    # include_reasoning false: the same content, no reasoning
    status, text = http(thinking_app, "/v1/chat/completions", {**body, "include_reasoning": False})
    again = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    assert [c["message"] for c in again] == [{"role": "assistant", "content": c["message"]["content"]}
                                             for c in choices]
    assert pools_all_free(thinking_app, {"prefill", "decode"})


@pytest.mark.slow
def test_a_forced_tool_call_comes_after_the_reasoning(thinking_app, thinking_model_dir):
    """tool_choice "required" is a grammar too: the call is written after </think>."""
    close = AutoTokenizer.from_pretrained(thinking_model_dir).convert_tokens_to_ids("</think>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Call f."}], "max_tokens": 60,
            "temperature": 1.0, "seed": 5, "n": 4, "logit_bias": {str(close): 7}, "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": False}
    status, text = http(thinking_app, "/v1/chat/completions", body)
    assert status == 200, text
    called = [c["message"] for c in json.loads(text)["choices"] if c["finish_reason"] == "tool_calls"]
    assert any(m.get("reasoning") for m in called), text
    for message in called:
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "f" and isinstance(json.loads(call["function"]["arguments"])["x"], int)
    assert pools_all_free(thinking_app, {"prefill", "decode"})



@pytest.mark.slow
def test_the_responses_api_gives_the_reasoning_as_a_reasoning_item_streamed_or_not(thinking_app):
    """/v1/responses on the same model (greedy; it has no logit_bias to close the block, so the
    output is cut inside its reasoning): one reasoning item, incomplete, the same text streamed."""
    body = {"model": "tiny", "input": "Think, then answer.", "max_output_tokens": 12, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}}
    status, text = http(thinking_app, "/v1/responses", body)
    assert status == 200, text
    out = json.loads(text)
    assert out["status"] == "incomplete" and [item["type"] for item in out["output"]] == ["reasoning"]
    reasoning = out["output"][0]["content"][0]["text"]
    assert reasoning and "think>" not in reasoning
    status, text = http(thinking_app, "/v1/responses", {**body, "stream": True})
    events = [e for e in sse_events(text) if e != "[DONE]"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == reasoning and events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == reasoning
    assert pools_all_free(thinking_app, {"prefill", "decode"})


@pytest.mark.slow
def test_anthropics_client_gets_the_reasoning_as_a_thinking_block_streamed_or_not(thinking_app):
    """/v1/messages on the same model (greedy, cut inside its reasoning, as above): one thinking
    block, the chat endpoint's reasoning, accumulated the same from the stream's thinking_delta
    events; the block goes back to the template as the turn's reasoning."""
    import anthropic
    client = anthropic.Anthropic(base_url=thinking_app, api_key="unused", max_retries=0)
    ask = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Think, then answer."}],
               extra_body={"temperature": 0})
    message = client.messages.create(**ask)
    status, text = http(thinking_app, "/v1/chat/completions", {"model": "tiny", "max_tokens": 12, "temperature": 0,
                                                               "messages": ask["messages"]})
    reasoning = json.loads(text)["choices"][0]["message"]["reasoning"]
    assert status == 200 and reasoning and "think>" not in reasoning
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", reasoning)]
    assert message.stop_reason == "max_tokens"
    with client.messages.stream(**ask) as stream:
        deltas = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta"
                         and e.delta.type == "thinking_delta")
        streamed = stream.get_final_message()
    assert deltas == reasoning and [(b.type, b.thinking) for b in streamed.content] == [("thinking", reasoning)]
    follow = client.messages.create(**{**ask, "max_tokens": 2, "messages": [
        *ask["messages"], {"role": "assistant", "content": message.content}, {"role": "user", "content": "Go on."}]})
    assert follow.stop_reason == "max_tokens"
    assert pools_all_free(thinking_app, {"prefill", "decode"})
