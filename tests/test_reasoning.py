"""Reasoning apart from content (router/reasoning.py, router/chat_output.py): where it starts, the
parser fed in any pieces adding up to the whole output, with tool calls after it, and over HTTP
through both pools with a template that leaves <think> open (a tiny model, its output forced by a
regex so that it closes the block)."""

import json
import random

import pytest
from transformers import AutoTokenizer

from router.chat_output import ChatOutputShape, Piece
from router.openai_protocol import ChatCompletionRequest
from router.reasoning import ReasoningStream, reasoning_template, starts_inside
from service_util import http, pools_all_free, sse_events, tiny_app
from tiny_models import tiny_model_dir

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
    output = ChatOutputShape(tools=True, reasoning=False).choice()
    reasoning, content, calls = output.message(text)
    assert reasoning == "The user wants f." and content is None
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"
    # streamed in pieces: the same reasoning, content and calls
    stream = ChatOutputShape(tools=True, reasoning=False).choice()
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
    for native in (True, False):
        conversation, _ = body.conversation(native)
        assert [m.get("reasoning_content") for m in conversation][1:3] == ["greet back", "older name"]


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_app(ray_serve, default_model_dir, tmp_path_factory):
    """The tiny model with a template whose generation prompt opens <think> (as DeepSeek-R1's)."""
    d = tiny_model_dir(tmp_path_factory.mktemp("thinking"), "llama", seed=0, tokenizer_dir=default_model_dir)
    (d / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with tiny_app(ray_serve, d, "think") as base:
        yield base


@pytest.mark.slow
def test_reasoning_comes_back_apart_through_both_pools(thinking_app):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 40,
            "temperature": 1.0, "seed": 3,
            "structured_outputs": {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n\n[a-z]{2,8}( [a-z]{2,8}){0,2}"}}
    status, text = http(thinking_app, "/v1/chat/completions", body)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "stop", choice
    assert message["reasoning"] and "think" not in message["reasoning"] and "\n" not in message["content"]
    status, text = http(thinking_app, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(text) if e != "[DONE]" and e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    # include_reasoning false: the same content, no reasoning
    status, text = http(thinking_app, "/v1/chat/completions", {**body, "include_reasoning": False})
    assert json.loads(text)["choices"][0]["message"] == {"role": "assistant", "content": message["content"]}
    assert pools_all_free(thinking_app, {"prefill", "decode"})
