"""Tool calls in the pythonic syntax (router/tools.py's PYTHONIC, router/pythonic_calls.py,
router/pythonic_grammar.py): the template read (vLLM's pythonic templates), the history's calls
through it, the forced-call grammar (every sentence it allows is a list of calls of allowed
functions whose arguments follow their schemas), the output parsed whole and streamed, and the
whole path through one engine and back through the template."""

import json
import random
from pathlib import Path

import jsonschema
import pytest

from chat_templates import PYTHONIC_TEMPLATE, tokenizer_with
from engine.structured_output import GrammarCompiler
from router.pythonic_calls import PythonicCallStream, arguments_json
from router.tool_parser import merge_calls
from router.tools import PYTHONIC, template_tools
from test_tools import HISTORY, SCHEMAS, request, split_tool_calls, stream_pieces, walk


@pytest.fixture(scope="module")
def tokenizer(default_model_dir, tmp_path_factory):
    """SmolLM2's tokenizer with the pythonic template (its directory: `name_or_path`)."""
    return tokenizer_with(default_model_dir, tmp_path_factory.mktemp("pythonic-tokenizer"), PYTHONIC_TEMPLATE)


def test_the_template_is_read_as_pythonic_and_writes_the_history_calls(tokenizer):
    assert template_tools(tokenizer) == (PYTHONIC, True)
    conversation, tools = request(messages=HISTORY).conversation(PYTHONIC)
    text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"name": "plan-route"' in text and "pdserve" not in text
    assert '<start_of_turn>model\n[get_weather(city="Paris", unit="celsius"), ping()]<end_of_turn>' in text
    assert "<start_of_turn>user\n<tool_response>\n18 degrees, sunny</tool_response>" in text


@pytest.mark.parametrize("text, arguments", [
    ('city="Paris", unit=\'celsius\'', {"city": "Paris", "unit": "celsius"}),
    ("n=-3, x=2.5, ok=True, no=false, none=None, null=null", {"n": -3, "x": 2.5, "ok": True, "no": False,
                                                              "none": None, "null": None}),
    ('stops=["a", \'b\'], opts={"deep": (1, 2)}, **{"a-b": 1}', {"stops": ["a", "b"], "opts": {"deep": [1, 2]},
                                                               "a-b": 1}),
    ("", {}),
    ('"Paris"', None),                       # positional
    ("city=paris", None),                    # a variable
    ("n=1 + 2", None),                       # an expression
    ("f=__import__('os').getcwd()", None),   # never evaluated
    ("n=", None),
])
def test_arguments_are_literals_read_without_evaluating_anything(text, arguments):
    got = arguments_json(text)
    assert (None if got is None else json.loads(got)) == arguments


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", True, {"get_weather", "plan-route", "ping"}),
    ({"type": "function", "function": {"name": "plan-route"}}, True, {"plan-route"}),
    ("required", False, {"get_weather", "plan-route", "ping"})])
def test_every_sentence_of_a_forced_call_is_a_call_that_follows_its_schema(tokenizer, choice, parallel, names):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    body = request(tool_choice=choice, parallel_tool_calls=parallel)
    assert body.tools_problem(PYTHONIC) is None
    spec = body.structured(PYTHONIC)
    seen, ended, several = set(), 0, False
    for seed in range(16):
        text, done = walk(compiler, spec, tokenizer, seed)
        if not done:
            continue
        ended += 1
        content, calls = split_tool_calls(text, PYTHONIC, parallel=parallel)
        assert text.startswith("[") and content is None and calls, text
        several |= len(calls) > 1
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            seen.add(call["function"]["name"])
    assert ended >= 8 and seen == names
    assert several == (choice == "required" and parallel)


def test_optional_parameters_may_be_left_out_and_odd_names_are_keyword_dicts():
    """A function whose parameters are optional, one of them no Python identifier: the grammar
    allows any subset in the schema's order, commas only between."""
    tools = [{"type": "function", "function": {"name": "opt", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b-c": {"enum": ["x"]}, "d": {"type": "boolean"}}}}}]
    body = request(tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert body.tools_problem(PYTHONIC) is None
    value = body.structured(PYTHONIC).value
    assert '"**{\\"b-c\\": "' in value and "h0_0: p0_0 t0_1 | h0_1" in value


CALL = 'get_weather(city="Paris", unit="celsius")'
OUTPUTS = [
    ("Plain text [with brackets] and [", "Plain text [with brackets] and [", []),
    (f"[{CALL}]", None, ["get_weather"]),
    (f"[{CALL}, ping()]", None, ["get_weather", "ping"]),
    (f" [ {CALL},\n  ping() ]\n\nDone.", "Done.", ["get_weather", "ping"]),
    ("[plan-route(stops=['Paris', 'Lyon'], fast=True)]", None, ["plan-route"]),
    ('[get_weather(city="a)b(", unit="celsius")]', None, ["get_weather"]),   # parentheses in a string
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ('[get_weather("Paris")]', '[get_weather("Paris")]', []),               # positional: content
    (f"[{CALL}, ping(x)]", "ping(x)]", ["get_weather"]),                     # a later one unreadable
    (f"[{CALL[:30]}", f"[{CALL[:30]}", []),                                  # cut off
]


@pytest.mark.parametrize("text, content, names", OUTPUTS)
def test_calls_streamed_split_anywhere_add_up_to_the_whole(text, content, names):
    whole, calls = split_tool_calls(text, PYTHONIC)
    assert whole == content and [c["function"]["name"] for c in calls] == names
    if names[:1] == ["get_weather"] and "Paris" in text:
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    rng = random.Random(0)
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        got, made = stream_pieces(PythonicCallStream(PYTHONIC.new_id), text, cuts)
        assert got == (content or "") and [c["function"] for c in merge_calls(made)] == [c["function"] for c in calls]
        assert [d["index"] for d in made if "id" in d] == list(range(len(names)))
    # content that cannot begin a call is not held back
    assert PythonicCallStream(PYTHONIC.new_id).feed("Hello")[0] == "Hello"


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = split_tool_calls(f"[{CALL}, ping()]", PYTHONIC, parallel=False)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_a_forced_call_through_an_engine_parses_and_goes_back_through_the_template(tokenizer, tmp_path):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from router.chat_prompt import chat_prompt_ids
    from tiny_models import tiny_model_dir
    model = tiny_model_dir(tmp_path, "gemma3_text", seed=0, tokenizer_dir=Path(tokenizer.name_or_path))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_memory="16MiB"))
    body = request(tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
                   temperature=0)
    ids = chat_prompt_ids(tokenizer, body, PYTHONIC)
    (out,) = engine.generate([ids], body.sampling_params(80, PYTHONIC))
    assert out.finish_reason == "stop" and out.text.startswith("[get_weather(city="), out.text
    content, calls = split_tool_calls(out.text, PYTHONIC)
    assert content is None and calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    again = request(messages=[*request().model_dump()["messages"], turn])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, again, PYTHONIC))
    assert f"<start_of_turn>model\n{out.text}<end_of_turn>" in text          # written back as the model wrote it
