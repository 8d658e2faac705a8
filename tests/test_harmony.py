"""gpt-oss's harmony format (router/harmony.py, the HARMONY syntax of router/tools.py): the output
parser fed in any pieces adding up to the whole output (reasoning, content and calls by channel
and recipient; plain text and stray tags), the template's detection and the history it is given,
the grammars that put what a request constrains in the answer after a free analysis
(router/harmony_grammar.py), and over HTTP through both pools with a tiny model whose vocabulary
has the harmony tags and a template of gpt-oss's shape: an output the request's grammar writes in
the format comes back as reasoning and content, a response_format value and a forced call after
the model's own analysis as content and a tool call, streamed the same as not."""

import json
import random

import pytest
from transformers import AutoTokenizer

from engine.structured_output import GrammarCompiler, StructuredOutput
from router.chat_output import ChatOutputShape, Piece
from router.chat_protocol import ChatCompletionRequest
from router.harmony_grammar import final_grammar
from router.tool_parser import merge_calls
from router.tools import HARMONY, template_tools, tool_grammar
from service_util import http, pools_all_free, sse_events, tiny_app
from tiny_models import tiny_model_dir

TAGS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# gpt-oss's template in outline: the developer message lists the tools, an assistant turn's
# reasoning is its analysis message (`thinking`), a call a commentary message to the function
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    "<|end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif -%}"
    "{%- if m.tool_calls -%}<|start|>assistant<|channel|>commentary to=functions.{{ m.tool_calls[0].function.name }}"
    " <|constrain|>json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- elif m.role == 'tool' -%}<|start|>functions.f to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt %}<|start|>assistant{% endif -%}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
CASES = [   # (output, reasoning, content, calls)
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>The answer.",
     "Think.", "The answer.", []),
    (f"<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant{CALL}",
     "Need the weather.", "", [("get_weather", '{"city": "Paris"}')]),
    # the recipient before the channel; a preamble to the user first
    ("<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     '<|message|>{"a": 1}', "", "Looking it up.", [("f", '{"a": 1}')]),
    ("plain text, no <|channel|> at its start", "", "plain text, no  at its start", []),
    ("<|channel|>analysis<|message|>cut short inside the reason", "cut short inside the reason", "", []),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", "a", "", []),   # a header cut short
    ("<|channel|>final<|message|>x<|end|> then text after its end", "", "x then text after its end", []),
    ("<|channel|>final<|message|>a stray <|constrain|> tag", "", "a stray  tag", []),
]


def feed_in_pieces(output, text: str, rng: random.Random, step: int) -> Piece:
    whole, at = Piece(), 0
    while at < len(text):
        n = step or rng.randint(1, 9)
        whole += output.feed(text[at:at + n])
        at += n
    whole += output.finish()
    return whole


@pytest.mark.parametrize("case", CASES)
def test_the_output_splits_by_channel_in_any_pieces(case):
    text, reasoning, content, calls = case
    rng = random.Random(0)
    for tools in (HARMONY, None):
        shape = ChatOutputShape(tools, None, harmony=True)
        for step in (0, 0, 1, len(text)):
            got = feed_in_pieces(shape.choice(), text, rng, step)
            assert (got.reasoning, got.content) == (reasoning, content if tools or not calls else
                                                    content + "".join(a for _, a in calls))
            merged = [(c["function"]["name"], c["function"]["arguments"]) for c in merge_calls(got.calls)]
            assert merged == (calls if tools else [])
        whole = shape.choice()
        message = whole.message(text)
        assert message[0] == (reasoning or None)
        assert whole.finish_reason("stop") == ("tool_calls" if calls and tools else "stop")
    shape = ChatOutputShape(HARMONY, None, include_reasoning=False, harmony=True)
    assert feed_in_pieces(shape.choice(), text, rng, 0).reasoning == ""


@pytest.fixture(scope="module")
def harmony_model_dir(tmp_path_factory, default_model_dir):
    """The tiny llama with the harmony tags as special tokens and TEMPLATE."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": TAGS})
    tokenizer.chat_template = TEMPLATE
    tokenizer_dir = tmp_path_factory.mktemp("harmony-tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    return tiny_model_dir(tmp_path_factory.mktemp("harmony"), "llama", seed=0, tokenizer_dir=tokenizer_dir)


def test_the_template_is_read_as_harmony_and_gets_the_history_as_gpt_oss_takes_it(harmony_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(harmony_model_dir)
    syntax, native = template_tools(tokenizer)
    assert syntax.name == HARMONY.name and native
    assert syntax.tokens == tuple(tokenizer.convert_tokens_to_ids(t) for t in ("<|channel|>", "<|constrain|>",
                                                                                "<|message|>", "<|start|>", "<|end|>"))
    body = ChatCompletionRequest.model_validate({
        "model": "tiny", "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "reasoning": "Call it.", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    messages, tools = body.conversation(syntax)
    assert messages[1]["thinking"] == "Call it." and tools[0]["function"]["name"] == "get_weather"
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ('<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>') in text
    # special tokens stay in the text the parser reads, whatever skip_special_tokens asked
    plain = AutoTokenizer.from_pretrained(tiny_model_dir(harmony_model_dir.parent / "plain", "llama"))
    assert not body.skips_special_tokens(syntax) and body.skips_special_tokens(template_tools(plain)[0])
    forced = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                   "tools": body.tools, "tool_choice": "required"})
    grammar = tool_grammar(forced.tools, forced.tool_choice, True, syntax)
    assert grammar.problem() is None and f"<[{syntax.tokens[0]}]>" in grammar.value


def test_a_grammar_constrains_the_answer_after_a_free_analysis(harmony_model_dir):
    """response_format's value, and a forced call, are the answer's message; before it the model
    may write an analysis message of any text (a tag inside it is refused); a regex applies from the
    first token, as for any model."""
    tokenizer = AutoTokenizer.from_pretrained(harmony_model_dir)
    syntax, _ = template_tools(tokenizer)
    tag = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepts(spec, text_or_tags) -> bool:
        matcher = compiler.matcher(spec)
        assert matcher.problem() is None
        ids = [i for piece in text_or_tags for i in
               ([tag[piece]] if piece in tag else tokenizer.encode(piece, add_special_tokens=False))]
        return all(matcher.accept(i) for i in ids) and matcher.accept(tokenizer.eos_token_id)

    analysis = ["<|channel|>", "analysis", "<|message|>", "Some <b>free</b>\ntext.", "<|end|>", "<|start|>",
                "assistant"]
    schema = StructuredOutput("json_schema", json.dumps(WEATHER))
    spec = final_grammar(schema, syntax.tokens)
    answer = ["<|channel|>", "final", "<|message|>", '{"city": "Paris"}']
    assert accepts(spec, analysis + answer) and accepts(spec, answer)
    assert not accepts(spec, analysis[:3] + ["<|channel|>"])                  # a tag inside the analysis
    assert not accepts(spec, answer[:3] + ['{"town": "Paris"}'])
    assert not accepts(spec, analysis)                                         # no answer
    choice = final_grammar(StructuredOutput("choice", json.dumps(["yes", "no"])), syntax.tokens)
    assert accepts(choice, analysis + answer[:3] + ["no"]) and not accepts(choice, answer[:3] + ["maybe"])
    regex = StructuredOutput("regex", "[a-z]+")
    assert final_grammar(regex, syntax.tokens) is regex
    call = ChatCompletionRequest.model_validate({
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}).structured(syntax)
    written = ["<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>",
               '{"city": "Paris"}']
    assert accepts(call, analysis + written) and accepts(call, written) and not accepts(call, answer)


@pytest.fixture(scope="module")
def harmony_app(ray_serve, harmony_model_dir):
    with tiny_app(ray_serve, harmony_model_dir, "harmony") as base:
        yield base


@pytest.mark.slow
def test_harmony_output_comes_back_as_reasoning_content_and_calls_through_both_pools(harmony_app, harmony_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(harmony_model_dir)
    tag = {t: f"<[{tokenizer.convert_tokens_to_ids(t)}]>" for t in TAGS}
    # a grammar writes the format (a tiny random model would not): analysis, then final
    grammar = (f'start: {tag["<|channel|>"]} "analysis" {tag["<|message|>"]} /[a-z]{{1,12}}/ {tag["<|end|>"]} '
               f'{tag["<|start|>"]} "assistant" {tag["<|channel|>"]} "final" {tag["<|message|>"]} /[a-z]{{1,12}}/')
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 60,
            "temperature": 1.0, "seed": 3, "n": 2, "structured_outputs": {"grammar": grammar}}
    status, text = http(harmony_app, "/v1/chat/completions", body)
    assert status == 200, text
    choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    for choice in choices:
        message = choice["message"]
        assert choice["finish_reason"] == "stop", choice
        assert message["reasoning"].isalpha() and message["content"].isalpha(), message
    status, text = http(harmony_app, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0] for e in sse_events(text) if e != "[DONE]" and e["choices"]]
    for choice in choices:
        mine = [d["delta"] for d in deltas if d["index"] == choice["index"]]
        assert "".join(d.get("reasoning") or "" for d in mine) == choice["message"]["reasoning"]
        assert "".join(d.get("content") or "" for d in mine) == choice["message"]["content"]
    # response_format: the final message's value, after the model's own analysis (nudged to end it: a
    # tiny random model would not)
    nudge = {str(tokenizer.convert_tokens_to_ids("<|end|>")): 6}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 60,
            "temperature": 1.0, "seed": 1, "n": 4, "logit_bias": nudge,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    status, text = http(harmony_app, "/v1/chat/completions", body)
    assert status == 200, text
    kinds = set()
    for choice in json.loads(text)["choices"]:
        message = choice["message"]
        if choice["finish_reason"] == "stop":
            assert set(json.loads(message["content"])) == {"city"}, choice
            kinds.add("answered after its analysis" if message.get("reasoning") else "answered")
        else:       # cut by max_tokens inside its analysis: no answer
            assert choice["finish_reason"] == "length" and not message["content"] and message["reasoning"], choice
    assert "answered after its analysis" in kinds, kinds
    # a forced call: one commentary message to the function (router/harmony_grammar.py)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
           "temperature": 0, "logit_bias": nudge, "tools": [{"type": "function", "function": {
               "name": "get_weather", "parameters": WEATHER}}],
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, text = http(harmony_app, "/v1/chat/completions", ask)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    status, text = http(harmony_app, "/v1/chat/completions", {**ask, "stream": True})
    deltas = [e["choices"][0] for e in sse_events(text) if e != "[DONE]" and e["choices"]]
    streamed = merge_calls([t for d in deltas for t in d["delta"].get("tool_calls") or ()])
    assert [c["function"] for c in streamed] == [call["function"]] and deltas[-1]["finish_reason"] == "tool_calls"
    # the conversation goes on with the call and its result (the template writes them)
    follow = {**ask, "tool_choice": "none", "max_tokens": 4, "messages": [
        *ask["messages"], {"role": "assistant", "content": None, "reasoning": "Call it.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}]}
    status, text = http(harmony_app, "/v1/chat/completions", follow)
    assert status == 200, text
    assert pools_all_free(harmony_app, {"prefill", "decode"})
