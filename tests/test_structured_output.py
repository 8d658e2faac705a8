"""Structured output and logit_bias: the specs' validation, the sampler's mask and bias, and
outputs of the engine (tiny random model, real tokenizer: whatever the weights prefer, the
grammar decides what may come out). A prefill engine and a decode engine continue one grammar."""

import json
import re

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampler import SampleRow, sample
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from engine_split import split_run

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPT = list(range(200, 230))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB"))


@pytest.mark.parametrize("spec", [StructuredOutput("json_object"), JSON_SCHEMA,
                                  StructuredOutput("json_schema", "{}"),
                                  StructuredOutput("regex", r"\d{3}-[a-z]+"),
                                  StructuredOutput("choice", json.dumps(["yes", "no", 'a "quoted" \\ one'])),
                                  StructuredOutput("lark", 'start: "x" NUMBER\nNUMBER: /[0-9]+/')])
def test_valid_specs_compile(spec):
    assert spec.problem() is None


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput("json_schema", "{not json"), "not JSON"),
    (StructuredOutput("json_schema", "[1]"), "must be a JSON object"),
    (StructuredOutput("json_schema", "true"), "must be a JSON object"),
    (StructuredOutput("json_schema", json.dumps({"type": "nonsense"})), "nonsense"),
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("choice", "[]"), "non-empty strings"),
    (StructuredOutput("choice", json.dumps(["a", 3])), "non-empty strings"),
    (StructuredOutput("lark", "start: missing_rule"), "missing_rule"),
    (StructuredOutput("xml", "<a/>"), "must be one of"),
    (StructuredOutput("regex", "a" * 70000), "longer than"),
])
def test_bad_specs_are_reported_not_raised(spec, words):
    problem = spec.problem()
    assert problem is not None and words in problem, problem
    assert words in SamplingParams(structured=spec).validate()


def test_params_that_cannot_go_with_a_grammar_or_a_bias_are_errors():
    assert "min_tokens" in SamplingParams(structured=JSON_SCHEMA, min_tokens=2, max_tokens=8).validate()
    assert "ignore_eos" in SamplingParams(structured=JSON_SCHEMA, ignore_eos=True).validate()
    assert "twice" in SamplingParams(logit_bias=((3, 1.0), (3, 2.0))).validate()
    assert "[-100, 100]" in SamplingParams(logit_bias=((3, 100.5),)).validate()
    assert "[-100, 100]" in SamplingParams(logit_bias=((-1, 1.0),)).validate()
    assert "300" in SamplingParams(logit_bias=tuple((t, 1.0) for t in range(301))).validate()
    assert SamplingParams(logit_bias=((3, -100.0), (4, 100.0)), structured=JSON_SCHEMA).validate() is None


def _bitmask(allowed: list[int], vocab: int) -> bytes:
    bits = bytearray((vocab + 31) // 32 * 4)
    for t in allowed:
        bits[t // 8] |= 1 << (t % 8)
    return bytes(bits)


def test_the_sampler_adds_the_bias_then_masks_what_the_grammar_forbids():
    vocab = 70
    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1)          # the last token is likeliest
    rows = [SampleRow(SamplingParams(temperature=0), None, [], allowed=_bitmask([3, 40, 41], vocab)),
            SampleRow(SamplingParams(temperature=0, logit_bias=((5, 100.0),)), None, []),
            SampleRow(SamplingParams(temperature=0, logit_bias=((41, -100.0),)), None, [],
                      allowed=_bitmask([3, 40, 41], vocab))]
    work = logits.clone()
    tokens, _ = sample(work, rows)
    assert tokens == [41, 5, 40]
    assert torch.isinf(work[0]).sum() == vocab - 3 and work[0, 41] == 41
    assert work[1, 5] == 105 and work[2, 41] == 41 - 100
    # sampled rows draw only allowed tokens
    g = torch.Generator().manual_seed(0)
    seen = {sample(torch.zeros(1, vocab), [SampleRow(SamplingParams(temperature=2.0), g, [],
                                                  allowed=_bitmask([3, 7, 69], vocab))])[0][0] for _ in range(60)}
    assert seen <= {3, 7, 69} and len(seen) > 1


def _run(engine, params, prompt=PROMPT):
    return engine.generate([prompt], params)[0]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_json_schema_output_is_a_value_of_the_schema(engine, seed):
    out = _run(engine, SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured=JSON_SCHEMA))
    assert out.finish_reason == "stop", out
    value = json.loads(out.text)
    assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
    assert 0 <= value["n"] <= 99 and value["tag"] in ("red", "green", "blue")
    assert out.token_ids[-1] in engine.eos_token_ids
    assert engine.block_manager.all_free()


def test_regex_choice_lark_and_json_object(engine):
    regex = _run(engine, SamplingParams(temperature=0, max_tokens=32, structured=StructuredOutput(
        "regex", r"[0-9]{3}-[a-z]{2,5}")))
    assert regex.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", regex.text), regex.text
    choices = ["apple pie", "banana", "cherry tart"]
    picked = {_run(engine, SamplingParams(temperature=1.5, seed=s, max_tokens=16, structured=StructuredOutput(
        "choice", json.dumps(choices)))).text for s in range(8)}
    assert picked <= set(choices) and picked
    lark = _run(engine, SamplingParams(temperature=0, max_tokens=32, structured=StructuredOutput(
        "lark", 'start: "x=" NUMBER ";"\nNUMBER: /[1-9][0-9]?/')))
    assert re.fullmatch(r"x=[1-9][0-9]?;", lark.text), lark.text
    obj = _run(engine, SamplingParams(temperature=0.8, seed=9, max_tokens=200, structured=StructuredOutput(
        "json_object")))
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:                         # cut by max_tokens: still the start of an object
        assert obj.finish_reason == "length" and obj.text.startswith("{")


def test_a_grammar_cut_by_max_tokens_or_a_stop_string_still_ends_cleanly(engine):
    cut = _run(engine, SamplingParams(temperature=0, max_tokens=3, structured=JSON_SCHEMA))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith('{"')
    stopped = _run(engine, SamplingParams(temperature=0, max_tokens=64, stop=('"n"',), structured=JSON_SCHEMA))
    assert stopped.finish_reason == "stop" and '"n"' not in stopped.text
    assert engine.block_manager.all_free()


def test_logit_bias_forces_and_forbids_tokens(engine):
    plain = _run(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    forced = _run(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=((1234, 100.0),)))
    assert forced.token_ids == [1234] * 6 and plain.token_ids != forced.token_ids
    banned = tuple((t, -100.0) for t in set(plain.token_ids))
    avoided = _run(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=banned))
    assert not set(avoided.token_ids) & set(plain.token_ids)
    rejected = engine.add_request("big", PROMPT, SamplingParams(logit_bias=((engine.runner.vocab_size, 1.0),)))
    assert rejected is not None and "out of range" in rejected.reason


def test_split_and_resumed_requests_follow_the_grammar_as_one_engine_does(engine, tiny_llama_dir):
    """The decode engine's matcher starts past the prefill engine's first token (and a resumed
    request's tokens), so a seeded request gives one engine's tokens; a first token the grammar
    does not allow is refused with the blocks left to the caller."""
    make = lambda: LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB"))
    prefill, decode = make(), make()
    for seed in (5, 6):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured=JSON_SCHEMA)
        whole = _run(engine, params)
        assert split_run(prefill, decode, f"s{seed}", PROMPT, params)[0].token_ids == whole.token_ids
        resumed = whole.token_ids[:4]
        again = split_run(prefill, decode, f"r{seed}", PROMPT, params, resumed)[0]
        assert resumed + again.token_ids == whole.token_ids
    blocks = decode.reserve(len(PROMPT))
    refused = decode.add_prefilled("bad", PROMPT, engine.tokenizer.encode("x")[0],
                                   SamplingParams(temperature=0, max_tokens=8, structured=JSON_SCHEMA), blocks)
    assert "does not follow" in refused.reason and decode.live_request_ids() == []
    decode.release_reservation(blocks)
    refused = engine.add_request("bad", PROMPT, SamplingParams(structured=JSON_SCHEMA, max_tokens=8),
                                 resumed=engine.tokenizer.encode("no"))
    assert "does not follow" in refused.reason
    assert all(e.block_manager.all_free() for e in (engine, prefill, decode))


SELF_REFERENCE = StructuredOutput("json_schema", json.dumps({"$ref": "#"}))   # compiles; fails at its first mask


def test_a_grammar_that_fails_is_a_rejection_at_admission_and_alone_mid_way(engine):
    """A grammar that fails at its first mask is refused at admission; one that fails later ends
    its own request with an error (blocks freed) while the step's other requests go on."""
    rejected = engine.add_request("selfref", PROMPT, SamplingParams(max_tokens=8, structured=SELF_REFERENCE))
    assert rejected is not None and "structured output" in rejected.reason
    assert engine.add_request("json", PROMPT, SamplingParams(temperature=0, max_tokens=30, structured=JSON_SCHEMA)) \
        is None
    assert engine.add_request("plain", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) is None
    engine.step()
    # the same real matcher a self-referring schema makes, now in the middle of a request
    engine._requests["json"].matcher = engine.admission.grammars.matcher(SELF_REFERENCE)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["json"].finished and outs["json"].finish_reason == "abort"
    assert "structured output's grammar" in outs["json"].error and not outs["json"].new_token_ids
    assert outs["json"].error_code == 400 and "\n" not in outs["json"].error    # llguidance's first line
    assert not outs["plain"].finished and outs["plain"].error is None
    rest = []
    while engine.has_work():
        rest += engine.step()
    assert rest[-1].request_id == "plain" and rest[-1].num_output_tokens == 8
    assert engine.live_request_ids() == [] and engine.block_manager.all_free()


def test_a_grammar_whose_mask_lets_through_a_token_it_then_refuses_ends_alone(engine):
    """llguidance's mask for a regex of control bytes (which SmolLM2's vocabulary has no plain
    tokens for) allows a token its parser then refuses (fuzzing found it: the step raised and
    every request of it was aborted). The request ends with a 400; the others go on."""
    for rid, params in (("ctl", SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                               structured=StructuredOutput("regex", "\x06\x0f"))),
                        ("plain", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))):
        assert engine.add_request(rid, PROMPT, params) is None
    outs = {}
    while engine.has_work():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outs["ctl"].finish_reason == "abort" and outs["ctl"].error_code == 400 and "grammar" in outs["ctl"].error
    assert outs["plain"].error is None and outs["plain"].num_output_tokens == 4
    assert engine.live_request_ids() == [] and engine.block_manager.all_free()


@pytest.mark.parametrize("code, kind", [(400, "invalid_request_error"), (500, "server_error")])
def test_a_failed_request_is_an_error_event_with_its_status_from_its_replica(code, kind):
    from engine.outputs import RequestOutput
    from serving import messages
    from serving.replica_util import engine_event
    event = messages.decode(engine_event(RequestOutput("x", [], "", True, "abort", 3, 1, error="structured output: no",
                                                       error_code=code)))
    assert isinstance(event, messages.ErrorEvent) and event.code == code and event.kind == kind
    assert "no" in event.message
