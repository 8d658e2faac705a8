"""Tool calls in IBM Granite's syntax (router/tools.py's GRANITE, router/array_calls.py): the
template read, the history's calls written into their turns' content (Granite's templates write
content only), the forced-call grammar through the <|tool_call|> token, the output parsed whole
and streamed, and the whole path through one engine and back through the template."""

import json
import random
from pathlib import Path

import jsonschema
import pytest

from chat_templates import GRANITE_TEMPLATE, GRANITE_TOKENS, tokenizer_with
from engine.structured_output import GrammarCompiler
from router.array_calls import ArrayCallStream
from router.tool_parser import merge_calls
from router.tools import GRANITE, template_tools
from test_tools import HISTORY, SCHEMAS, request, split_tool_calls, stream_pieces, walk

MARK = "<|tool_call|>"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir, tmp_path_factory):
    """SmolLM2's tokenizer with Granite's template and tokens (its directory: `name_or_path`)."""
    return tokenizer_with(default_model_dir, tmp_path_factory.mktemp("granite-tokenizer"), GRANITE_TEMPLATE,
                          GRANITE_TOKENS)


@pytest.fixture(scope="module")
def syntax(tokenizer):
    syntax, native = template_tools(tokenizer)
    assert native and syntax.name == "granite" and syntax.calls_in_content
    assert syntax.marker_id == tokenizer.convert_tokens_to_ids(MARK)
    return syntax


def test_the_history_calls_are_written_into_their_turns_content(tokenizer, syntax):
    conversation, tools = request(messages=HISTORY).conversation(syntax)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "plan-route", "ping"]
    text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "respond with <|tool_call|>" in text and '"name": "plan-route"' in text and "pdserve" not in text
    calls = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, ' \
            '{"name": "ping", "arguments": {}}]'
    assert f"<|start_of_role|>assistant<|end_of_role|>{MARK}{calls}<|end_of_text|>" in text
    assert "<|start_of_role|>tool<|end_of_role|>18 degrees, sunny<|end_of_text|>" in text
    assert text.endswith("<|start_of_role|>assistant<|end_of_role|>")
    # the marker reaches the model as its token (in the system text and the history), as the model writes it
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(syntax.marker_id) == 2
    # content beside the calls stays before them
    turn = {**HISTORY[1], "content": "Checking."}
    conversation, _ = request(messages=[HISTORY[0], turn, *HISTORY[2:]]).conversation(syntax)
    assert conversation[1]["content"] == f"Checking.{MARK}{calls}"
    assert "tool_calls" not in conversation[1]
    assert syntax.new_id().startswith("call_")


def test_calls_are_decoded_with_their_marker_and_forced_through_its_token(syntax):
    assert request().sampling_params(20, syntax).skip_special_tokens is False      # the parser needs the marker
    assert request(tool_choice="none").sampling_params(20, syntax).skip_special_tokens is True
    spec = request(tool_choice="required").structured(syntax).value
    assert f'start: <[{syntax.marker_id}]> "[" call (", " call)* "]"' in spec
    assert '"<|tool_call|>[" call' in request(tool_choice="required").structured(GRANITE).value


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "plan-route", "ping"}),
    ({"type": "function", "function": {"name": "plan-route"}}, {"plan-route"})])
def test_every_sentence_of_a_forced_call_is_a_call_that_follows_its_schema(tokenizer, syntax, choice, names):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = request(tool_choice=choice).structured(syntax)
    seen, ended = set(), 0
    for seed in range(12):
        text, done = walk(compiler, spec, tokenizer, seed)     # special tokens kept
        if not done:
            continue
        ended += 1
        assert text.startswith(MARK + "[{")
        content, calls = split_tool_calls(text, syntax)
        assert content is None and calls, text
        assert len(calls) == 1 or choice == "required", text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            seen.add(call["function"]["name"])
    assert ended >= 6 and seen == names


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
PING = '{"name": "ping", "arguments": {}}'
OUTPUTS = [
    ("The weather is fine <|tool_", "The weather is fine <|tool_", []),
    (f"{MARK}[{CALL}]", None, ["get_weather"]),
    (f"{MARK}[{CALL}, {PING}]", None, ["get_weather", "ping"]),
    (f"{MARK} [\n  {CALL},\n  {PING}\n]", None, ["get_weather", "ping"]),
    (f"I will look it up.\n{MARK}[{CALL}]", "I will look it up.", ["get_weather"]),
    ('<|tool_call|>[{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}]', None,
     ["get_weather"]),                                                                 # read whole
    ('<|tool_call|>[{"city": "Paris"}]', '<|tool_call|>[{"city": "Paris"}]', []),     # not a call: content
    (f"{MARK}[{CALL[:50]}", None, ["get_weather"]),                                   # cut inside its arguments
]


@pytest.mark.parametrize("text, content, names", OUTPUTS)
def test_calls_streamed_split_anywhere_add_up_to_the_whole(syntax, text, content, names):
    whole, calls = split_tool_calls(text, syntax)
    assert whole == content and [c["function"]["name"] for c in calls] == names
    if calls and text.endswith("]") and "Paris" in text:
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    rng = random.Random(0)
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        got, made = stream_pieces(ArrayCallStream(syntax), text, cuts)
        assert got == (content or "") and [c["function"] for c in merge_calls(made)] == [c["function"] for c in calls]
        assert [d["index"] for d in made if "id" in d] == list(range(len(names)))
        assert all(d["id"].startswith("call_") for d in made if "id" in d)


def test_a_forced_call_through_an_engine_comes_out_with_its_marker_and_goes_back_into_the_history(
        tokenizer, syntax, tmp_path):
    """The router's pieces around one engine: the prompt from the template, the grammar through the
    <|tool_call|> token, the engine's text with the marker kept, the parser; then the calls go
    back through the template as the model wrote them."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from router.chat_prompt import chat_prompt_ids
    from tiny_models import tiny_model_dir
    model = tiny_model_dir(tmp_path, "granite", seed=0, tokenizer_dir=Path(tokenizer.name_or_path))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_memory="16MiB"))
    body = request(tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0)
    ids = chat_prompt_ids(tokenizer, body, syntax)
    (out,) = engine.generate([ids], body.sampling_params(80, syntax))
    assert out.finish_reason == "stop" and out.text.startswith(MARK + "[{"), out.text
    content, calls = split_tool_calls(out.text, syntax)
    assert content is None and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS["get_weather"])
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    results = [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "done"}]
    again = request(messages=[*request().model_dump()["messages"], turn, *results])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, again, syntax))
    arguments = json.loads(calls[0]["function"]["arguments"])
    written = json.dumps([{"name": "get_weather", "arguments": arguments}])
    assert f"<|start_of_role|>assistant<|end_of_role|>{MARK}{written}<|end_of_text|>" in text
