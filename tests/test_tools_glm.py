"""Tool calls in GLM-4.5's syntax (router/tools.py's GLM45, router/hermes_calls.py): the template
read, the history's calls written as its key / value blocks, the output's blocks parsed whole and
streamed (a string parameter's value as its text, any other as JSON; Hermes' JSON blocks too,
which a forced call writes), and a call through one engine back into the history."""

import json
import random
from pathlib import Path

import pytest

from chat_templates import GLM45_TEMPLATE, tokenizer_with
from router.chat_output import ChatOutputShape
from router.hermes_calls import ToolCallStream
from router.tool_parser import merge_calls
from router.tools import GLM45, HERMES, template_tools
from test_tools import HISTORY, request, stream_pieces


@pytest.fixture(scope="module")
def tokenizer(default_model_dir, tmp_path_factory):
    """SmolLM2's tokenizer with GLM-4.5's template (its directory: `name_or_path`)."""
    return tokenizer_with(default_model_dir, tmp_path_factory.mktemp("glm45-tokenizer"), GLM45_TEMPLATE)


@pytest.fixture(scope="module")
def syntax(tokenizer):
    syntax, native = template_tools(tokenizer)
    assert native and syntax.name == GLM45.name
    return syntax


def test_the_history_calls_are_written_as_key_value_blocks(tokenizer, syntax):
    conversation, tools = request(messages=HISTORY).conversation(syntax)
    text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<arg_key>{arg-key-1}</arg_key>" in text and '"name": "plan-route"' in text and "pdserve" not in text
    assert ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n"
            "<arg_value>celsius</arg_value>\n</tool_call><tool_call>ping\n</tool_call>") in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text and text.endswith("<|assistant|>")


def test_calls_keep_their_tags_and_a_forced_one_is_a_json_block(syntax):
    # the tags may be special tokens in GLM's vocabulary: kept in the text the parser reads
    assert request().sampling_params(20, syntax).skip_special_tokens is False
    assert request(tool_choice="none").sampling_params(20, syntax).skip_special_tokens is True
    forced = request(tool_choice="required")
    assert forced.structured(syntax).value == forced.structured(HERMES).value
    shape = ChatOutputShape.of(request(), syntax, None)
    assert dict(shape.string_args) == {"get_weather": ("city",), "plan-route": (), "ping": ()}
    assert ChatOutputShape.of(request(tool_choice="none"), syntax, None).tools is None


BLOCK = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n" \
        "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>"
ROUTE = '<tool_call>plan-route<arg_key>stops</arg_key><arg_value>["A", "B"]</arg_value>' \
        '<arg_key>fast</arg_key><arg_value>true</arg_value></tool_call>'        # GLM-4.7's: no newlines
OUTPUTS = [   # (output, content, [(name, arguments)])
    (BLOCK, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"Let me check.\n{BLOCK}\n{ROUTE}", "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("plan-route", {"stops": ["A", "B"], "fast": True})]),
    # a string parameter keeps its text even where it reads as JSON
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n</tool_call>", None,
     [("get_weather", {"city": "123"})]),
    ("<tool_call>ping\n</tool_call>", None, [("ping", {})]),
    ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None, [("ping", {})]),    # a forced call's
    ("<tool_call>get weather\n</tool_call>", "<tool_call>get weather\n</tool_call>", []),      # not a name
    ("<tool_call>ping<arg_key>a</arg_key>stray</tool_call>", "<tool_call>ping<arg_key>a</arg_key>stray</tool_call>",
     []),
]


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_blocks_streamed_split_anywhere_add_up_to_the_whole(syntax, text, content, calls):
    shape = ChatOutputShape.of(request(), syntax, None)
    _, whole, made = shape.choice().message(text)
    assert whole == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in made] == calls
    rng = random.Random(0)
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        got, deltas = stream_pieces(ToolCallStream(dict(shape.string_args)), text, cuts)
        assert got == (content or "") and [c["function"] for c in merge_calls(deltas)] == [c["function"] for c in made]
    # Hermes' parser (another model) leaves these blocks in the content
    if calls and not text.startswith("<tool_call>\n{"):
        assert ChatOutputShape(tools=HERMES).choice().message(text)[2] == []


def test_a_call_through_an_engine_goes_back_into_the_history(tokenizer, syntax, tmp_path):
    """The router's pieces around one engine: the prompt from the template, a call written in the
    key / value syntax (a grammar of the request, as the tiny random model would not), the parser;
    then the call goes back through the template as the model wrote it."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from router.chat_prompt import chat_prompt_ids
    from tiny_models import tiny_model_dir
    model = tiny_model_dir(tmp_path, "llama", seed=0, tokenizer_dir=Path(tokenizer.name_or_path))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_memory="16MiB"))
    grammar = ('start: "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>" /[A-Z][a-z]{2,8}/ '
               '"</arg_value>\\n<arg_key>unit</arg_key>\\n<arg_value>celsius</arg_value>\\n</tool_call>"')
    body = request(max_tokens=120, temperature=0, structured_outputs={"grammar": grammar})
    ids = chat_prompt_ids(tokenizer, body, syntax)
    (out,) = engine.generate([ids], body.sampling_params(120, syntax))
    assert out.finish_reason == "stop", out.text
    _, content, calls = ChatOutputShape.of(body, syntax, None).choice().message(out.text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert arguments["unit"] == "celsius" and arguments["city"].isalpha()
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    again = request(messages=[*request().model_dump()["messages"], turn,
                              {"role": "tool", "tool_call_id": calls[0]["id"], "content": "done"}])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, again, syntax))
    assert f"<arg_value>{arguments['city']}</arg_value>" in text and "<tool_response>\ndone" in text
