"""Tool calls in Mistral's syntax (router/tools.py's MISTRAL, router/array_calls.py): the template
read, the history's call ids made ones it takes, the forced-call grammar through its [TOOL_CALLS]
token, the output parsed whole and streamed, and the whole path through one engine (the text
decoded with the marker kept)."""

import json
import random
from pathlib import Path

import jsonschema
import pytest

from chat_templates import MISTRAL_TEMPLATE, MISTRAL_TOKENS, tokenizer_with
from engine.structured_output import GrammarCompiler
from router.array_calls import ArrayCallStream
from router.tool_parser import merge_calls
from router.tools import MISTRAL, template_tools
from test_tools import HISTORY, SCHEMAS, request, split_tool_calls, stream_pieces, walk


@pytest.fixture(scope="module")
def tokenizer(default_model_dir, tmp_path_factory):
    """SmolLM2's tokenizer with Mistral's template and tokens (its directory: `name_or_path`)."""
    return tokenizer_with(default_model_dir, tmp_path_factory.mktemp("mistral-tokenizer"), MISTRAL_TEMPLATE,
                          MISTRAL_TOKENS)


@pytest.fixture(scope="module")
def syntax(tokenizer):
    syntax, native = template_tools(tokenizer)
    assert native and syntax.name == "mistral"
    assert syntax.marker_id == tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    return syntax


def test_the_template_gets_the_tools_and_the_history_with_ids_it_takes(tokenizer, syntax):
    body = request(messages=HISTORY)
    conversation, tools = body.conversation(syntax)
    text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "[AVAILABLE_TOOLS]" in text and '"name": "plan-route"' in text and "pdserve" not in text
    # OpenAI's ids ("call_1") would make the template raise: each maps to 9 letters and digits, the
    # same for a call and its result
    calls = conversation[1]["tool_calls"]
    ids = [c["id"] for c in calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    assert [m["tool_call_id"] for m in conversation[2:]] == ids
    assert f'"arguments": {{"city": "Paris", "unit": "celsius"}}, "id": "{ids[0]}"}}' in text
    assert f'"call_id": "{ids[1]}"}}[/TOOL_RESULTS]' in text
    # ids already of that shape (its own answers') pass unchanged
    assert syntax.history_id("a1B2c3D4e") == "a1B2c3D4e" and syntax.history_id(ids[0]) == ids[0]
    assert len(syntax.new_id()) == 9 and syntax.new_id().isalnum()


def test_calls_are_decoded_with_their_marker_and_forced_through_its_token(syntax):
    assert request().sampling_params(20, syntax).skip_special_tokens is False      # the parser needs the marker
    assert request(tool_choice="none").sampling_params(20, syntax).skip_special_tokens is True
    spec = request(tool_choice="required").structured(syntax).value
    assert f"start: <[{syntax.marker_id}]> \" [\" call (\", \" call)* \"]\"" in spec
    # a tokenizer without the token: the marker is text
    assert '"[TOOL_CALLS] [" call' in request(tool_choice="required").structured(MISTRAL).value


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", True, {"get_weather", "plan-route", "ping"}),
    ({"type": "function", "function": {"name": "plan-route"}}, True, {"plan-route"})])
def test_every_sentence_of_a_forced_call_is_a_call_that_follows_its_schema(tokenizer, syntax, choice, parallel, names):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = request(tool_choice=choice, parallel_tool_calls=parallel).structured(syntax)
    seen, ended = set(), 0
    for seed in range(12):
        text, done = walk(compiler, spec, tokenizer, seed)     # special tokens kept
        if not done:
            continue
        ended += 1
        assert text.startswith("[TOOL_CALLS] [{")
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
    ("Plain text [with brackets] and [TOOL", "Plain text [with brackets] and [TOOL", []),
    (f"[TOOL_CALLS] [{CALL}]", None, ["get_weather"]),
    (f"[TOOL_CALLS][{CALL}, {PING}]", None, ["get_weather", "ping"]),
    (f"Let me check.\n[TOOL_CALLS] [{CALL}]", "Let me check.", ["get_weather"]),
    (f"[TOOL_CALLS] [{CALL[:-1]}, \"id\": \"abcdefghi\"}}]", None, ["get_weather"]),   # its history's id copied
    (f"[TOOL_CALLS] [{CALL}]\n\nDone.", "Done.", ["get_weather"]),                    # content after the array
    ('[TOOL_CALLS] [{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "g"}]', None, ["g"]),  # read whole
    ('[TOOL_CALLS] [{"city": "Paris"}]', '[TOOL_CALLS] [{"city": "Paris"}]', []),      # not a call: content
    ('[TOOL_CALLS]\n[{"city": "Paris"}]', '[TOOL_CALLS]\n[{"city": "Paris"}]', []),
    ("[TOOL_CALLS] no array", "[TOOL_CALLS] no array", []),
    ("[TOOL_CALLS] []", "", []),
    (f"[TOOL_CALLS] [{CALL[:60]}", None, ["get_weather"]),                             # cut inside its arguments
    (f'[TOOL_CALLS] [{PING}, {{"name": "pi', '{"name": "pi', ["ping"]),                 # cut before: content
]


@pytest.mark.parametrize("text, content, names", OUTPUTS)
def test_calls_streamed_split_anywhere_add_up_to_the_whole(syntax, text, content, names):
    whole, calls = split_tool_calls(text, syntax)
    assert whole == content and [c["function"]["name"] for c in calls] == names
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    if calls and "Paris" in text and text != f"[TOOL_CALLS] [{CALL[:60]}":
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    rng = random.Random(0)
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        got, made = stream_pieces(ArrayCallStream(syntax), text, cuts)
        assert got == (content or "") and [c["function"] for c in merge_calls(made)] == [c["function"] for c in calls]
        assert [d["index"] for d in made if "id" in d] == list(range(len(names)))
        if cuts[0] == 1 and text.startswith(f"[TOOL_CALLS] [{CALL}"):
            assert len(made) > len(names) + 5       # the arguments went out in pieces
    # content that cannot be the marker is not held back
    assert ArrayCallStream(syntax).feed("Hello")[0] == "Hello"


def test_parallel_tool_calls_false_keeps_the_first_call(syntax):
    two = f"[TOOL_CALLS] [{CALL}, {PING}]"
    content, calls = split_tool_calls(two, syntax, parallel=False)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    got, made = stream_pieces(ArrayCallStream(syntax, first_only=True), two, [1] * len(two))
    assert got == "" and [c["function"] for c in merge_calls(made)] == [calls[0]["function"]]


def test_a_forced_call_through_an_engine_comes_out_with_its_marker_and_parses(tokenizer, syntax, tmp_path):
    """The router's pieces around one engine: the prompt from the template, the request's sampling
    parameters (the grammar through the [TOOL_CALLS] token, special tokens kept in the text), the
    engine's detokenized text, the parser; then the call goes back through the template."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from router.chat_prompt import chat_prompt_ids
    from tiny_models import tiny_model_dir
    model = tiny_model_dir(tmp_path, "llama", seed=0, tokenizer_dir=Path(tokenizer.name_or_path))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_memory="16MiB"))
    body = request(tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0)
    ids = chat_prompt_ids(tokenizer, body, syntax)
    (out,) = engine.generate([ids], body.sampling_params(80, syntax))
    assert out.finish_reason == "stop" and out.text.startswith("[TOOL_CALLS] [{"), out.text
    content, calls = split_tool_calls(out.text, syntax)
    assert content is None and calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "done"} for c in calls]
    again = request(messages=[*request().model_dump()["messages"], turn, *results])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, again, syntax))
    assert all(f'"call_id": "{c["id"]}"' in text for c in calls)      # its own ids, unchanged
