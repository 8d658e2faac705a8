"""Every kind of bad input gets an OpenAI-format 4xx, and the server stays up with every pool
back to all blocks free."""

import json
import socket
import time
from urllib.parse import urlparse

import pytest

from service_util import http, pools_all_free

pytestmark = pytest.mark.slow
M = "SmolLM2-135M-Instruct"
GOOD = {"model": M, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

CASES = [
    ("invalid json", "/v1/completions", b'{"model": "x", "prompt": ', 400),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400),
    ("invalid utf-8", "/v1/completions", b'{"model": "' + bytes([0xff, 0xfe]) + b'", "prompt": "x"}', 400),
    ("prompt wrong type", "/v1/completions", {**GOOD, "prompt": 123}, 400),
    ("max_tokens wrong type", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400),
    ("temperature wrong type", "/v1/completions", {**GOOD, "temperature": "hot"}, 400),
    ("model wrong type", "/v1/completions", {**GOOD, "model": 5}, 400),
    ("missing prompt", "/v1/completions", {"model": M}, 400),
    ("missing messages", "/v1/chat/completions", {"model": M}, 400),
    ("unknown field", "/v1/completions", {**GOOD, "frobnicate": 1}, 400),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-17"}, 404),
    ("loading a LoRA adapter where runtime_lora_updating is off", "/v1/load_lora_adapter",
     {"lora_name": "x", "lora_path": "/tmp"}, 404),
    ("unloading one", "/v1/unload_lora_adapter", {"lora_name": "x"}, 404),
    ("priority on a first-come-first-served server", "/v1/chat/completions", {**CHAT, "priority": -1}, 400),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400),
    ("empty token prompt", "/v1/completions", {**GOOD, "prompt": []}, 400),
    ("token id out of range", "/v1/completions", {**GOOD, "prompt": [10**9]}, 400),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400),
    ("bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("image content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("beyond context", "/v1/completions", {**GOOD, "prompt": "word " * 9000}, 400),
    ("prompt + max_tokens beyond context", "/v1/completions", {**GOOD, "prompt": "word " * 4500, "max_tokens": 4000}, 400),
    ("max_tokens above the limit", "/v1/completions", {**GOOD, "max_tokens": 5000}, 400),
    ("max_tokens above the limit, max_completion_tokens below", "/v1/chat/completions",
     {**CHAT, "max_tokens": 5000, "max_completion_tokens": 2}, 400),
    ("max_tokens zero", "/v1/completions", {**GOOD, "max_tokens": 0}, 400),
    ("max_tokens negative", "/v1/completions", {**GOOD, "max_tokens": -5}, 400),
    ("max_tokens huge", "/v1/completions", {**GOOD, "max_tokens": 10**12}, 400),
    ("temperature negative", "/v1/completions", {**GOOD, "temperature": -1}, 400),
    ("temperature too high", "/v1/completions", {**GOOD, "temperature": 3}, 400),
    ("top_p zero", "/v1/completions", {**GOOD, "top_p": 0}, 400),
    ("top_p above one", "/v1/completions", {**GOOD, "top_p": 1.5}, 400),
    ("top_k below -1", "/v1/completions", {**GOOD, "top_k": -2}, 400),
    ("min_p above one", "/v1/completions", {**GOOD, "min_p": 1.5}, 400),
    ("stop token id out of range", "/v1/completions", {**GOOD, "stop_token_ids": [10**6]}, 400),
    ("65 stop token ids", "/v1/chat/completions", {**CHAT, "stop_token_ids": list(range(65))}, 400),
    ("min_tokens negative", "/v1/completions", {**GOOD, "min_tokens": -1}, 400),
    ("allowed token id out of range", "/v1/completions", {**GOOD, "allowed_token_ids": [5, 10**6]}, 400),
    ("empty allowed_token_ids", "/v1/chat/completions", {**CHAT, "allowed_token_ids": []}, 400),
    ("allowed_token_ids with response_format", "/v1/chat/completions",
     {**CHAT, "allowed_token_ids": [5], "response_format": {"type": "json_object"}}, 400),
    ("allowed_token_ids only EOS before min_tokens", "/v1/completions",
     {**GOOD, "allowed_token_ids": [2], "min_tokens": 1}, 400),
    ("truncate_prompt_tokens zero", "/v1/completions", {**GOOD, "truncate_prompt_tokens": 0}, 400),
    ("an empty bad word", "/v1/completions", {**GOOD, "bad_words": ["x", ""]}, 400),
    ("65 bad words", "/v1/completions", {**GOOD, "bad_words": [f"w{i}" for i in range(65)]}, 400),
    ("bad_words with a forced tool call", "/v1/chat/completions", {
        **CHAT, "bad_words": ["x"], "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, 400),
    ("truncate_prompt_tokens -2", "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": -2}, 400),
    ("skip_special_tokens wrong type", "/v1/completions", {**GOOD, "skip_special_tokens": "no"}, 400),
    ("empty stop", "/v1/completions", {**GOOD, "stop": [""]}, 400),
    ("stop wrong type", "/v1/completions", {**GOOD, "stop": 5}, 400),
    ("too many stops", "/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(20)]}, 400),
    ("n above 16", "/v1/completions", {**GOOD, "n": 17}, 400),
    ("prompts x n above 16", "/v1/completions", {**GOOD, "prompt": ["a", "b", "c"], "n": 6}, 400),
    ("17 prompts", "/v1/completions", {**GOOD, "prompt": ["a"] * 17}, 400),
    ("an empty prompt in a batch", "/v1/completions", {**GOOD, "prompt": ["a", ""]}, 400),
    ("an empty token prompt in a batch", "/v1/completions", {**GOOD, "prompt": [[1, 2], []]}, 400),
    ("mixed prompt batch", "/v1/completions", {**GOOD, "prompt": ["a", [1, 2]]}, 400),
    ("n zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400),
    ("best_of > 1", "/v1/completions", {**GOOD, "best_of": 2}, 400),
    ("negative seed", "/v1/completions", {**GOOD, "seed": -1}, 400),
    ("presence_penalty above 2", "/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400),
    ("frequency_penalty below -2", "/v1/chat/completions", {**CHAT, "frequency_penalty": -3}, 400),
    ("repetition_penalty zero", "/v1/completions", {**GOOD, "repetition_penalty": 0}, 400),
    ("logprobs above 20", "/v1/completions", {**GOOD, "logprobs": 21}, 400),
    ("logprobs negative", "/v1/completions", {**GOOD, "logprobs": -1}, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400),
    ("top_logprobs above 20", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400),
    ("prompt_logprobs streamed", "/v1/completions", {**GOOD, "prompt_logprobs": 1, "stream": True}, 400),
    ("prompt_logprobs of the whole vocabulary", "/v1/chat/completions", {**CHAT, "prompt_logprobs": -1}, 400),
    ("echo wrong type", "/v1/completions", {**GOOD, "echo": [1]}, 400),
    ("echo on chat of the wrong type", "/v1/chat/completions", {**CHAT, "echo": "yes"}, 400),
    ("a request's own chat template", "/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, 400),
    ("request_id too long", "/v1/completions", {**GOOD, "request_id": "x" * 257}, 400),
    ("truncation_side neither left nor right", "/v1/completions",
     {**GOOD, "truncate_prompt_tokens": 2, "truncation_side": "middle"}, 400),
    ("lone surrogate in the prompt", "/v1/completions", b'{"model": "%s", "prompt": "a\\udcf3"}' % M.encode(), 400),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % M.encode(), 400),
    ("max_tokens a numeric string", "/v1/completions", {**GOOD, "max_tokens": "2"}, 400),
    ("max_tokens a fraction", "/v1/completions", {**GOOD, "max_tokens": 2.5}, 400),
    ("n a boolean", "/v1/completions", {**GOOD, "n": True}, 400),
    ("echo a number", "/v1/completions", {**GOOD, "echo": 1}, 400),
    ("top_k above 2^31 - 1", "/v1/completions", {**GOOD, "top_k": 2**64}, 400),
    ("response_format of an unknown type", "/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400),
    ("json_schema without its schema object", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema"}}, 400),
    ("a schema that does not compile", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400),
    ("a regex that does not compile", "/v1/completions", {**GOOD, "structured_outputs": {"regex": "a(b"}}, 400),
    ("two structured_outputs", "/v1/completions", {**GOOD, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400),
    ("response_format and structured_outputs", "/v1/completions", {
        **GOOD, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400),
    ("response_format with min_tokens", "/v1/chat/completions", {
        **CHAT, "response_format": {"type": "json_object"}, "min_tokens": 1}, 400),
    ("logit_bias above 100", "/v1/completions", {**GOOD, "logit_bias": {"5": 101}}, 400),
    ("logit_bias key not a token id", "/v1/completions", {**GOOD, "logit_bias": {"hello": 1}}, 400),
    ("logit_bias token id out of range", "/v1/completions", {**GOOD, "logit_bias": {"49152": 1}}, 400),
    ("logit_bias naming a token twice", "/v1/completions", {**GOOD, "logit_bias": {"5": 1, "05": 2}}, 400),
    ("oversized body", "/v1/completions", b'{"model": "x", "prompt": "' + b"a" * (5 * 2**20) + b'"}', 413),
]


# the field a union failure names (router/validation_errors.py), not pydantic's member names
PARAMS = {"prompt wrong type": "prompt", "model wrong type": "model", "stop wrong type": "stop",
          "mixed prompt batch": "prompt.1", "image content": "messages.0.content.0.type",
          "a request's own chat template": "chat_template", "request_id too long": "request_id",
          "truncation_side neither left nor right": "truncation_side"}


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_4xx(disagg, name, path, body, status):
    raw = body if isinstance(body, bytes) else None
    got, text = http(disagg, path, None if raw else body, raw=raw)
    assert got == status, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if name in PARAMS:
        assert error["param"] == PARAMS[name] and error["message"].startswith(PARAMS[name] + ": "), error


def test_an_oversized_body_still_being_sent_gets_its_413_not_a_reset(disagg):
    """The refusal is decided from the headers, but the router reads the rest of the body first
    (router/guards.py), so a client still sending reads the 413 instead of a broken pipe or a reset
    connection (a client under load met those: with `Connection: close` the proxy closes the
    connection once the refusal is out, and a body not yet through meets the close). Here the body
    starts only after the headers have had time to be refused."""
    url = urlparse(disagg)
    body = b'{"model": "x", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
    with socket.create_connection((url.hostname, url.port), timeout=60) as s:
        s.sendall(f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                  "Connection: close\r\n\r\n".encode())         # as urllib sends: closed after the reply
        time.sleep(1.0)
        for i in range(0, len(body), 256 * 1024):
            s.sendall(body[i:i + 256 * 1024])
        reply = b""
        while not reply.endswith(b"}") and (chunk := s.recv(65536)):
            reply += chunk
    head, _, text = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(text)["error"]["code"] == "body_too_large"


def test_server_still_serves_and_nothing_leaked(disagg):
    assert http(disagg, "/v1/completions", GOOD)[0] == 200
    assert http(disagg, "/v1/chat/completions", CHAT)[0] == 200
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_without_model_the_served_model_answers(disagg):
    """`model` omitted or null means the served model (vLLM's and llama-server's reading; OpenAI's
    own API requires it), on every endpoint that takes one; the reply names the served model."""
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT),
                       ("/v1/responses", {"model": M, "input": "Hi", "max_output_tokens": 2})):
        for model in ({}, {"model": None}):
            request = {k: v for k, v in body.items() if k != "model"} | model
            status, text = http(disagg, path, request)
            assert status == 200, (path, text)
            assert json.loads(text)["model"] == M
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
        assert http(disagg, path, body)[0] == 200


@pytest.mark.parametrize("extra", [
    {"max_tokens": 2.0, "n": 2.0},                                         # JSON Schema's integers include 2.0
    {"seed": 2**64 + 5},                                                   # used modulo 2^63
    {"temperature": 5e-324}, {"temperature": 1e-40, "repetition_penalty": 1e-300},   # (a 500 once: the
    {"top_p": 5e-324}, {"top_p": 1e-40, "top_k": 2**31 - 1},               # engine's float32 turned them into
    {"repetition_penalty": 5e-324, "presence_penalty": -2, "frequency_penalty": 2},  # 0 or inf)
], ids=str)
def test_extreme_values_within_the_bounds_are_served(disagg, extra):
    body = {**GOOD, "prompt": "Hello there", "max_tokens": 3, "temperature": 1.0, **extra}   # sampled
    status, text = http(disagg, "/v1/completions", body)
    assert status == 200, text


def test_unknown_route_and_wrong_method_are_openai_errors(disagg):
    for method_path, expected in (("/v1/nothing", 404), ("/v1/models", 405)):
        status, text = http(disagg, method_path, {"x": 1})
        assert status == expected and json.loads(text)["error"]["message"]
