"""Structured output and logit_bias over HTTP, through both pools and the KV transfer (and the
colocated replica): the output follows the grammar wherever its tokens were sampled, streamed or
not, and every block is free after."""

import json
import re

import jsonschema
import pytest

from service_util import http, pools_all_free, sse_events

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}}}
ASK = [{"role": "user", "content": "Describe a person who likes animals, as JSON."}]


def test_the_openai_client_gets_values_of_its_json_schema(disagg, colocated):
    import openai
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for base in (disagg, colocated):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=80,
                                             temperature=0.8, seed=7, n=3)
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        streamed = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=80,
                                                  temperature=0.8, seed=7, n=1, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == out.choices[0].message.content       # the same seed, streamed
        whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                               response_format={"type": "json_object"})
        if whole.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(whole.choices[0].message.content), dict)
        else:
            assert whole.choices[0].message.content.startswith("{")
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})


def test_vllm_structured_outputs_on_completions(disagg):
    body = {"model": MODEL, "prompt": "The best fruit is", "max_tokens": 12, "temperature": 1.0}
    choices = ["apple", "banana split", "cherry"]
    for seed in range(4):
        status, text = http(disagg, "/v1/completions", {**body, "seed": seed,
                                                        "structured_outputs": {"choice": choices}})
        assert status == 200, text
        out = json.loads(text)["choices"][0]
        assert out["text"] in choices and out["finish_reason"] == "stop", out
    status, text = http(disagg, "/v1/completions", {**body, "stream": True, "structured_outputs": {
        "regex": "[0-9]{2}:[0-9]{2} (am|pm)"}})
    assert status == 200, text
    events = sse_events(text)
    assert re.fullmatch("[0-9]{2}:[0-9]{2} (am|pm)", "".join(e["choices"][0]["text"] for e in events[:-1]))
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_logit_bias_reaches_both_pools(disagg, default_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    banana = tok.encode(" banana")
    assert len(banana) == 1
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    forced = json.loads(http(disagg, "/v1/completions", {**body, "logit_bias": {str(banana[0]): 100}})[1])
    assert forced["choices"][0]["text"] == " banana" * 4
    plain = json.loads(http(disagg, "/v1/completions", {**body, "logprobs": 0})[1])["choices"][0]
    first = plain["logprobs"]["tokens"][0]
    first_id = tok.encode(first)
    assert len(first_id) == 1 and tok.decode(first_id) == first
    banned = json.loads(http(disagg, "/v1/completions", {**body, "logprobs": 0, "logit_bias": {
        str(first_id[0]): -100}})[1])["choices"][0]
    assert banned["logprobs"]["tokens"][0] != first
    assert pools_all_free(disagg, {"prefill", "decode"})
