"""Tools (function calling) in the router, without a server: the requests it takes and refuses,
the prompt a template gets (its own tool syntax, or pdserve's text), the grammar of a forced call
(walked token by token through llguidance with the real tokenizer: every sentence it allows is
a call of an allowed function whose arguments follow its schema), and the parsers, streamed or
whole; each in both call syntaxes (Hermes' <tool_call> blocks, Llama 3's JSON)."""

import json
import random

import jsonschema
import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from chat_templates import LLAMA3_TEMPLATE, tokenizer_with
from engine.structured_output import MAX_SPEC_CHARS, GrammarCompiler
from router.chat_output import ChatOutputShape
from router.chat_protocol import ChatCompletionRequest
from router.hermes_calls import ToolCallStream
from router.llama3_calls import JsonCallStream
from router.tool_parser import merge_calls
from router.tools import CLOSE, HERMES, LLAMA3_JSON, template_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# "#/..." references resolve against the function's own schema
ROUTE = {"type": "object", "$defs": {"place": {"type": "string", "maxLength": 8}},
         "properties": {"stops": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/place"}},
                        "fast": {"type": "boolean"}},
         "required": ["stops", "fast"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "plan-route", "parameters": ROUTE}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "plan-route": ROUTE, "ping": {"type": "object", "maxProperties": 0}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [*USER, {"role": "assistant", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "pong"}]


def split_tool_calls(text: str, syntax=HERMES, parallel=True) -> tuple[str | None, list[dict]]:
    """A whole output's content and calls, as the router builds a message."""
    _, content, calls = ChatOutputShape(tools=syntax, parallel=parallel).choice().message(text)
    return content, calls


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS, **fields})


# ---- requests ----------------------------------------------------------------------------------
def test_tool_choice_defaults_and_what_it_forces():
    assert request().chosen_tools == "auto" and request().parses_tool_calls and request().structured() is None
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": USER})
    assert plain.chosen_tools == "none" and not plain.parses_tool_calls
    none = request(tool_choice="none")
    assert not none.parses_tool_calls and none.conversation(False)[0] == plain.conversation(False)[0]
    assert request(tool_choice="required").structured().kind == "lark"
    named = request(tool_choice={"type": "function", "function": {"name": "ping"}}).structured()
    assert '\\"ping\\"' in named.value and "get_weather" not in named.value
    # "auto" with one call at most: the output ends at the first call's end
    assert request(parallel_tool_calls=False, stop="x").sampling_params(20).stop == ("x", "</tool_call>")
    assert request().sampling_params(20).stop == ()
    with pytest.raises(ValidationError, match="at most 15 stop strings"):
        request(parallel_tool_calls=False, stop=[str(i) for i in range(16)])
    # a forced call with logit_bias or penalties is fine; the sampling params carry the grammar
    assert request(tool_choice="required", logit_bias={"5": 1.0}).sampling_params(20).structured.kind == "lark"


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": "auto", "tools": None}, "needs tools"),
    ({"tool_choice": "required", "tools": None}, "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "distinct"),
    ({"tools": []}, "at least 1"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "takes no response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "ping"}}, "structured_outputs": {"regex": "a"}},
     "takes no response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "pattern"),
    ({"messages": [{"role": "user"}]}, "needs content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]}, "only assistant"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "only tool messages"),
    ({"messages": [{"role": "assistant", "content": None}]}, "needs content"),
])
def test_requests_that_do_not_agree_are_refused(fields, words):
    with pytest.raises(ValidationError, match=words):
        request(**fields)


def test_a_forced_functions_schema_that_does_not_compile_is_named():
    """Checked apart from the request's shape (`tools_problem`: it compiles, so the router runs it
    off its event loop); only the functions a call may be forced to."""
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    problem = request(tools=[*TOOLS, bad], tool_choice="required").tools_problem()
    assert problem.startswith("tools: function 'broken': parameters") and "nowhere" in problem
    assert request(tools=[*TOOLS, bad], tool_choice={"type": "function", "function": {"name": "ping"}}).tools_problem() \
        is None
    assert request(tools=[*TOOLS, bad]).tools_problem() is None       # auto compiles nothing
    assert request(tool_choice="required").tools_problem() is None and request(tool_choice="required").forces_call
    assert not request().forces_call


# ---- render ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call them as <tool_call></tool_call> blocks.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def native_tokenizer(default_model_dir, tmp_path_factory):
    """The default model's tokenizer with a template in Qwen2.5's tool syntax."""
    return tokenizer_with(default_model_dir, tmp_path_factory.mktemp("native"), NATIVE_TEMPLATE)


@pytest.fixture(scope="module")
def llama3_tokenizer(default_model_dir, tmp_path_factory):
    return tokenizer_with(default_model_dir, tmp_path_factory.mktemp("llama3"), LLAMA3_TEMPLATE)


def render(tok, body: ChatCompletionRequest) -> str:
    syntax, native = template_tools(tok)
    conversation, tools = body.conversation(syntax if native else None)
    return tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)


def test_a_template_without_tools_gets_pdserves_text_and_the_history_written_out(tokenizer):
    assert template_tools(tokenizer) == (HERMES, False)
    text = render(tokenizer, request(messages=HISTORY))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and "<tool_call></tool_call> XML tags" in system
    for tool in TOOLS:
        assert json.dumps(tool) in system          # each function's definition, as given
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call><|im_end|>') in text
    # both results in one user turn, then the generation prompt
    assert text.endswith("<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response>\n"
                         "<tool_response>\npong\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a system message of the client's keeps its words, the tools after them
    text = render(tokenizer, request(messages=[{"role": "developer", "content": "Be brief."}, *USER]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # tool_choice none: no tools shown, the history still written out
    text = render(tokenizer, request(messages=HISTORY, tool_choice="none"))
    assert "# Tools" not in text and "SmolLM" in text and "<tool_response>\npong" in text


def test_a_template_with_tools_gets_them_and_the_history_as_transformers_passes_it(native_tokenizer):
    assert template_tools(native_tokenizer) == (HERMES, True)
    text = render(native_tokenizer, request(messages=HISTORY))
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>{")
    assert "pdserve" not in text and "XML tags" not in text     # the template's words, not pdserve's
    assert '"name": "plan-route"' in text
    # arguments reach the template as an object (not JSON text inside JSON)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert "# Tools" not in render(native_tokenizer, request(tool_choice="none"))


def test_a_llama3_template_gets_the_tools_and_one_call_a_turn_in_its_own_syntax(llama3_tokenizer):
    assert template_tools(llama3_tokenizer) == (LLAMA3_JSON, True)
    one_call = [*USER, {**HISTORY[1], "tool_calls": HISTORY[1]["tool_calls"][:1]}, HISTORY[2]]
    text = render(llama3_tokenizer, request(messages=one_call))
    assert '"name": "plan-route"' in text and "pdserve" not in text and "<tool_call>" not in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
            '{"city": "Paris", "unit": "celsius"}}<|eot_id|>') in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18 degrees, sunny<|eot_id|>" in text
    # its grammar writes that syntax; parallel_tool_calls cannot make it write two
    spec = request(tool_choice="required").structured(LLAMA3_JSON)
    assert '\\"parameters\\": ' in spec.value and "tool_call" not in spec.value and "call)*" not in spec.value
    # and no </tool_call> stop for "auto" with one call at most: its parser keeps the first
    assert request(parallel_tool_calls=False).sampling_params(20, LLAMA3_JSON).stop == ()


# ---- constrain ---------------------------------------------------------------------------------
def walk(compiler: GrammarCompiler, spec, tok, seed: int, limit: int = 160) -> tuple[str, bool]:
    """A random sentence of the grammar (any allowed token, uniformly): (text, ended with EOS)."""
    matcher, rng, out = compiler.matcher(spec), random.Random(seed), []
    for _ in range(limit):
        allowed = np.nonzero(np.unpackbits(np.frombuffer(matcher.bitmask(), np.uint8), bitorder="little"))[0]
        allowed = allowed[allowed < compiler.vocab_size]
        # EOS one time in four when allowed, so sentences end
        token = tok.eos_token_id if tok.eos_token_id in allowed and rng.random() < 0.25 else int(rng.choice(allowed))
        if token == tok.eos_token_id:
            return tok.decode(out), True
        assert matcher.accept(token)
        out.append(token)
    return tok.decode(out), False


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", True, {"get_weather", "plan-route", "ping"}),
    ("required", False, {"get_weather", "plan-route", "ping"}),
    ({"type": "function", "function": {"name": "plan-route"}}, True, {"plan-route"})])
@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON], ids=lambda s: s.name)
def test_every_sentence_of_a_forced_call_is_a_call_that_follows_its_schema(tokenizer, choice, parallel, names,
                                                                           syntax):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = request(tool_choice=choice, parallel_tool_calls=parallel).structured(syntax)
    seen, ended = set(), 0
    for seed in range(12):
        text, done = walk(compiler, spec, tokenizer, seed)
        if not done:
            continue
        ended += 1
        content, calls = split_tool_calls(text, syntax)
        assert content is None and calls, text
        assert len(calls) == 1 or (parallel and choice == "required" and syntax.parallel), text
        for call in calls:
            assert call["function"]["name"] in names
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            seen.add(call["function"]["name"])
    assert ended >= 6 and seen == names


DESCRIBED = {"type": "object", "title": "Order", "description": "An order. " * 20, "$comment": "internal",
             "required": ["description", "items"], "additionalProperties": False,
             "$defs": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "Stock unit", "examples": ["ABC"]}},
             "properties": {
                 "description": {"type": "string", "maxLength": 10, "description": "a property named description"},
                 "items": {"type": "array", "minItems": 1, "maxItems": 2, "description": "what",
                           "items": {"anyOf": [{"$ref": "#/$defs/sku", "title": "a sku"},
                                               {"type": "integer", "minimum": 1, "default": 5, "deprecated": True}]}},
                 "tag": {"enum": [{"description": "an enum value, kept"}, "plain"], "title": "kept values"}}}


def test_annotations_are_dropped_from_schemas_and_nothing_else():
    from engine.structured_output import without_annotations
    bare = without_annotations(DESCRIBED)
    assert set(bare) == {"type", "required", "additionalProperties", "$defs", "properties"}
    assert set(bare["properties"]) == {"description", "items", "tag"}          # property names stay
    assert bare["properties"]["description"] == {"type": "string", "maxLength": 10}
    assert bare["properties"]["tag"] == {"enum": [{"description": "an enum value, kept"}, "plain"]}
    assert bare["properties"]["items"]["items"]["anyOf"] == [{"$ref": "#/$defs/sku"}, {"type": "integer", "minimum": 1}]
    assert bare["$defs"]["sku"] == {"type": "string", "pattern": "^[A-Z]{3}$"}
    assert DESCRIBED["title"] == "Order"                                           # the input is left alone
    values = [{"description": "short", "items": ["ABC", 3]}, {"description": "far too long here", "items": [1]},
              {"description": "x", "items": []}, {"description": "x", "items": ["abc"]}, {"items": [1]},
              {"description": "x", "items": [0]}, {"description": "x", "items": [2], "tag": "plain"},
              {"description": "x", "items": [2], "tag": {"description": "an enum value, kept"}},
              {"description": "x", "items": [2], "tag": "other"}, {"description": "x", "items": [2], "more": 1}]
    valid = [jsonschema.Draft202012Validator(DESCRIBED).is_valid(v) for v in values]
    assert [jsonschema.Draft202012Validator(bare).is_valid(v) for v in values] == valid
    assert valid.count(True) == 3


def test_a_large_described_tool_set_is_forced_by_a_grammar_of_its_structure(tokenizer):
    """128 functions whose parameters carry descriptions (most of their text, as agents' tools do):
    the grammar leaves the descriptions out, so it stays under the spec limit and compiles."""
    said = "What the model should put here, in a few words. " * 4
    forecast = {"type": "object", "description": said, "required": ["city", "days"], "additionalProperties": False,
                "properties": {"city": {"type": "string", "maxLength": 12, "description": said},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": said}}}
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing. " * 10,
                                               "parameters": forecast}} for i in range(128)]
    assert 128 * len(json.dumps(forecast)) > 1.5 * MAX_SPEC_CHARS      # whole, the schemas would not fit
    spec = request(tools=tools, tool_choice="required").structured(HERMES)
    assert spec.problem() is None and "a few words" not in spec.value
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    ended = 0
    for seed in range(6):
        text, done = walk(compiler, spec, tokenizer, seed, limit=120)
        if done:
            ended += 1
            for call in split_tool_calls(text)[1]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), forecast)
    assert ended
    schema_format = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "order", "schema": DESCRIBED}}}).structured()
    assert "Order" not in schema_format.value and json.loads(schema_format.value)["required"] == ["description", "items"]


# ---- parse -------------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
OUTPUTS = [
    ("Plain text, with  spaces and a < sign\n\n", "Plain text, with  spaces and a < sign\n\n", []),
    ("ends in a partial tag <tool_ca", "ends in a partial tag <tool_ca", []),
    (CALL, None, ["get_weather"]),
    ("Let me look.\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n", "Let me look.", ["get_weather"] * 2),
    (CALL + "\nDone.", "Done.", ["get_weather"]),
    ("a <tool_call>\nnot json\n</tool_call> b", "a <tool_call>\nnot json\n</tool_call> b", []),
    ('<tool_call>["a list"]</tool_call>', '<tool_call>["a list"]</tool_call>', []),
    (CALL[:-len("\n</tool_call>")], None, ["get_weather"]),         # cut after its JSON: still a call
    (CALL[:40], CALL[:40], []),                                      # cut before its arguments: content
    (CALL[:70], None, ["get_weather"]),                              # cut inside them: a call, arguments cut
    ('<tool_call>{"name": "ping", "parameters": {"x": 1}}</tool_call>', None, ["ping"]),
]


LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA3_OUTPUTS = [
    ("Plain text; with {braces} later\n", "Plain text; with {braces} later\n", []),
    (LLAMA3_CALL, None, ["get_weather"]),
    ("  \n" + LLAMA3_CALL + "\n", None, ["get_weather"]),
    ("<|python_tag|>" + LLAMA3_CALL, None, ["get_weather"]),
    (LLAMA3_CALL + "; " + LLAMA3_CALL.replace("get_weather", "ping"), None, ["get_weather", "ping"]),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),                 # JSON, not a call: content
    (LLAMA3_CALL + " and then some words", "and then some words", ["get_weather"]),   # a call, then content
    ('{"parameters": {"a": 1}, "name": "f"} and words', '{"parameters": {"a": 1}, "name": "f"} and words', []),
    ('{"parameters": {"city": "Paris", "unit": "celsius"}, "name": "g"}', None, ["g"]),   # read whole
    (LLAMA3_CALL[:30], LLAMA3_CALL[:30], []),                         # cut before its arguments: content
    (LLAMA3_CALL[:60], None, ["get_weather"]),                        # cut inside them: a call, arguments cut
    ("<|python", "<|python", []),
]


def stream_pieces(stream, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    got, made, at = "", [], 0
    for n in cuts:
        piece, new = stream.feed(text[at:at + n])
        got, made, at = got + piece, made + new, at + n
    piece, new = stream.finish()
    return got + piece, made + new


@pytest.mark.parametrize("text, content, names", LLAMA3_OUTPUTS)
def test_llama3_json_calls_streamed_split_anywhere_add_up_to_the_whole(text, content, names):
    whole, calls = split_tool_calls(text, LLAMA3_JSON)
    assert whole == content and [c["function"]["name"] for c in calls] == names
    if calls and text != LLAMA3_CALL[:60]:
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    rng = random.Random(0)
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        got, made = stream_pieces(JsonCallStream(), text, cuts)
        assert got == (content or "") and [c["function"] for c in merge_calls(made)] == [c["function"] for c in calls]
        assert [d["index"] for d in made if "id" in d] == list(range(len(names)))
        if cuts[0] == 1 and '"parameters": {"city"' in text and text.lstrip().startswith(("{\"name", "<|")):
            assert len(made) > len(names) + 5       # the arguments went out in pieces
    # content that cannot be a call is not held back
    if not text.lstrip().startswith(("{", "<|")):
        assert JsonCallStream().feed(text[:3]) == (text[:3], [])


def test_llama3_json_with_parallel_tool_calls_false_keeps_the_first_call():
    two = LLAMA3_CALL + "; " + LLAMA3_CALL.replace("get_weather", "ping")
    content, calls = split_tool_calls(two, LLAMA3_JSON, parallel=False)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    got, made = stream_pieces(JsonCallStream(first_only=True), two, [1] * len(two))
    assert got == "" and merge_calls(made) == [{**calls[0], "id": made[0]["id"]}]


@pytest.mark.parametrize("text, content, names", OUTPUTS)
def test_a_stream_split_anywhere_adds_up_to_the_whole_output(text, content, names):
    whole, calls = split_tool_calls(text)
    assert whole == content and [c["function"]["name"] for c in calls] == names
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    rng = random.Random(0)
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        stream, got, made, at = ToolCallStream(), "", [], 0
        for n in cuts:
            piece, new = stream.feed(text[at:at + n])
            got, made, at = got + piece, made + new, at + n
        piece, new = stream.finish()
        got, made = got + piece, made + new
        assert got == (content or "") and [c["function"] for c in merge_calls(made)] == [c["function"] for c in calls]
        # each call's first delta has its id, type and name; the others more of its arguments
        firsts = [d for d in made if "id" in d]
        assert [d["index"] for d in firsts] == list(range(len(names)))
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} and d["function"]["arguments"]
                   for d in made if "id" not in d)
        assert [d["index"] for d in made] == sorted(d["index"] for d in made)


@pytest.mark.parametrize("text, streamed", [
    (CALL, '{"city": "Paris", "unit": "celsius"}'),
    ('<tool_call>{"name": "write", "parameters": {"text": "a long } text }}"} }</tool_call>', '{"text": "a long } text }}"}'),
    ('<tool_call>\n{"name": "write", "arguments": {"path": "a.py", "text": "def f():\\n    return 1\\n"}}', None)])
def test_a_calls_arguments_stream_as_the_model_writes_them(text, streamed):
    """Fed a character at a time: the name goes out once the block's head is read, then the
    arguments a piece at a time, always the text so far from the arguments' brace on, less what
    may be the block's own closing brace."""
    key = '"arguments": {' if '"arguments": {' in text else '"parameters": {'
    begins = text.index(key) + len(key) - 1
    stream, made, states = ToolCallStream(), [], []
    for at, ch in enumerate(text, 1):
        made += stream.feed(ch)[1]
        assert bool(made) == (at > begins), text[:at]           # the name as soon as the brace shows
        so_far = "".join(d["function"]["arguments"] for d in made)
        assert text[begins:at].startswith(so_far)
        states.append(so_far)
    made += stream.finish()[1]
    arguments = merge_calls(made)[0]["function"]["arguments"]
    assert made[0]["function"]["name"] == ("get_weather" if text == CALL else "write")
    assert all(arguments.startswith(state) for state in states)
    assert len([d for d in made if "id" not in d]) > 10            # it streamed
    assert json.loads(arguments) and arguments == (streamed or arguments)
    assert not text.endswith(CLOSE) or json.loads(arguments) == _arguments_of(text)


def _arguments_of(text: str) -> dict:
    body = json.loads(text[len("<tool_call>"):-len("</tool_call>")])
    return body.get("arguments", body.get("parameters"))


def test_arguments_come_out_as_json_text():
    _, calls = split_tool_calls(CALL)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    # a model that writes the arguments as JSON text already, or as a bare string
    _, calls = split_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                                '<tool_call>{"name": "g", "arguments": "plain"}</tool_call>')
    assert [c["function"]["arguments"] for c in calls] == ['{"a": 1}', '"plain"']
