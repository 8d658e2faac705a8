"""A chat request's prompt (router/chat_prompt.py): vLLM's add_generation_prompt,
continue_final_message, chat_template_kwargs, documents and add_special_tokens, through the real
tokenizer's template (and ones that read a variable, or add a BOS), and over HTTP through both pools."""

import json
import shutil

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from router.chat_prompt import chat_prompt_ids
from router.chat_protocol import ChatCompletionRequest
from service_util import http, pools_all_free

MODEL = "SmolLM2-135M-Instruct"
PREFILLED = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A ripe yellow"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": PREFILLED, **fields})


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def text(tok, body) -> str:
    return tok.decode(chat_prompt_ids(tok, body, native_tools=None))


def test_the_last_message_left_open_or_closed_or_a_new_turn(tokenizer):
    opened = text(tokenizer, request())
    assert opened.endswith("A ripe yellow<|im_end|>\n<|im_start|>assistant\n")
    closed = text(tokenizer, request(add_generation_prompt=False))
    assert closed == opened[:-len("<|im_start|>assistant\n")]
    assert text(tokenizer, request(add_generation_prompt=False, continue_final_message=True)) == \
        closed[:-len("<|im_end|>\n")]


def test_template_variables_reach_the_template(default_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    body = {"messages": PREFILLED[:1]}
    assert text(tok, request(**body)).endswith("<|im_start|>assistant\n")
    assert text(tok, request(**body, chat_template_kwargs={"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_effort_is_the_templates_variable_from_chat_responses_and_tokenize(default_model_dir, tmp_path):
    """OpenAI's `reasoning_effort` (the Responses API's `reasoning.effort`) reaches the template as
    the variable of that name (gpt-oss's template reads it), chat_template_kwargs before it; a
    template without it is unchanged."""
    from router.responses_protocol import ResponsesRequest
    from router.tokenize_protocol import TokenizeRequest
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}|{{ reasoning_effort | default('unset') }}")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    body = {"messages": PREFILLED[:1]}
    assert text(tok, request(**body)).endswith("|unset")
    assert text(tok, request(**body, reasoning_effort="low")).endswith("|low")
    assert text(tok, request(**body, reasoning_effort="low",
                             chat_template_kwargs={"reasoning_effort": "high"})).endswith("|high")
    chat = ResponsesRequest.model_validate({"model": MODEL, "input": "Hi", "reasoning": {"effort": "minimal"}}).chat()
    assert text(tok, chat) == "Hi|minimal"
    tokenized = TokenizeRequest.model_validate({**body, "reasoning_effort": "medium"}).chat(MODEL)
    assert text(tok, tokenized).endswith("|medium")
    with pytest.raises(ValidationError, match="reasoning_effort go with messages"):
        TokenizeRequest.model_validate({"prompt": "x", "reasoning_effort": "low"})
    assert text(tokenizer := AutoTokenizer.from_pretrained(default_model_dir), request(reasoning_effort="high")) == \
        text(tokenizer, request())


def bos_tokenizer(default_model_dir, where, template: str | None = None):
    """The default model's tokenizer made to add a BOS (<|endoftext|>) as Llama's and Gemma's do."""
    from tokenizers.processors import TemplateProcessing
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.bos_token = "<|endoftext|>"
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                              special_tokens=[("<|endoftext|>", bos)])
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(where)
    return AutoTokenizer.from_pretrained(where)


def test_add_special_tokens_and_documents_reach_the_prompt_as_vllm_takes_them(default_model_dir, tmp_path):
    """vLLM's add_special_tokens: chat's default (false) leaves the template's text as it is, true
    adds the tokenizer's BOS before it; /tokenize defaults as each endpoint does (a prompt: true,
    messages: false). `documents` reach a template that reads them."""
    from router.tokenize_protocol import TokenizeRequest
    tok = bos_tokenizer(default_model_dir, tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}"
                        "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}")
    bos = tok.bos_token_id
    assert tok.encode("Hi")[0] == bos and tok.encode("Hi", add_special_tokens=False)[0] != bos
    body = {"messages": PREFILLED[:1]}
    plain = chat_prompt_ids(tok, request(**body), None)
    assert plain == tok.encode("Name a fruit.", add_special_tokens=False)
    assert chat_prompt_ids(tok, request(**body, add_special_tokens=True), None) == [bos, *plain]
    docs = [{"title": "Fruit", "text": "Apples are red."}, {"title": "Veg", "text": "Kale."}]
    assert tok.decode(chat_prompt_ids(tok, request(**body, documents=docs), None)) == \
        "Name a fruit.[Fruit: Apples are red.][Veg: Kale.]"
    tokenized = TokenizeRequest.model_validate({**body, "documents": docs})
    assert chat_prompt_ids(tok, tokenized.chat(MODEL), None) == chat_prompt_ids(tok, request(**body, documents=docs),
                                                                                 None)
    assert TokenizeRequest.model_validate(body).chat(MODEL).add_special_tokens is False
    assert TokenizeRequest.model_validate({**body, "add_special_tokens": True}).chat(MODEL).add_special_tokens is True
    assert TokenizeRequest.model_validate({**body, "add_special_tokens": None}).chat(MODEL).add_special_tokens is False
    for wrong in ({"documents": []}, {"documents": [{"title": 1}]}, {"documents": [{}] * 65},
                  {"add_special_tokens": "yes"}):
        with pytest.raises(ValidationError):
            request(**body, **wrong)
    with pytest.raises(ValidationError, match="documents go with messages"):
        TokenizeRequest.model_validate({"prompt": "x", "documents": docs})


def test_openais_other_chat_fields_are_accepted_and_change_nothing(tokenizer):
    fields = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "modalities": ["text"],
              "safety_identifier": "user-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
              "verbosity": "low"}
    assert text(tokenizer, request(**fields)) == text(tokenizer, request())
    assert request(**fields).sampling_params(16) == request().sampling_params(16)
    for wrong in ({"modalities": ["audio"]}, {"service_tier": "fastest"}, {"metadata": {"k": 1}},
                  {"metadata": {f"k{i}": "v" for i in range(17)}}, {"reasoning_effort": "maximal"},
                  {"verbosity": "terse"}, {"prompt_cache_retention": "1h"}):
        with pytest.raises(ValidationError):
            request(**wrong)


@pytest.mark.parametrize("fields, words", [
    ({"continue_final_message": True}, "needs add_generation_prompt false"),
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": PREFILLED[:1]},
     "the assistant's"),
    ({"chat_template_kwargs": {"tools": [], "tokenize": False}}, "may not set tokenize, tools"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(33)}}, "at most 32"),
    ({"chat_template": "{{ messages }}"}, "a request's own chat template is not accepted"),
])
def test_prompt_shapes_that_cannot_be_are_refused(fields, words):
    with pytest.raises(ValidationError, match=words):
        request(**fields)


@pytest.mark.slow
def test_a_prefilled_answer_is_continued_through_both_pools(disagg, tokenizer):
    body = {"model": MODEL, "messages": PREFILLED, "max_tokens": 8, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    status, out = http(disagg, "/v1/chat/completions", body)
    assert status == 200, out
    out = json.loads(out)
    expected = chat_prompt_ids(tokenizer, ChatCompletionRequest.model_validate(body), native_tools=None)
    assert out["usage"]["prompt_tokens"] == len(expected)
    # the same prompt as a completion gives the same tokens
    status, same = http(disagg, "/v1/completions", {"model": MODEL, "prompt": expected, "max_tokens": 8,
                                                    "temperature": 0})
    assert status == 200 and json.loads(same)["choices"][0]["text"] == out["choices"][0]["message"]["content"]
    # vLLM's echo: the prefilled message, then the same continuation
    status, echoed = http(disagg, "/v1/chat/completions", {**body, "echo": True})
    assert status == 200 and json.loads(echoed)["choices"][0]["message"]["content"] == \
        PREFILLED[-1]["content"] + out["choices"][0]["message"]["content"]
    status, bad = http(disagg, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert status == 400 and "add_generation_prompt" in json.loads(bad)["error"]["message"]
    status, bad = http(disagg, "/v1/chat/completions", {**body, "chat_template": "{{ messages }}"})
    error = json.loads(bad)["error"]
    assert status == 400 and error["param"] == "chat_template" and "own chat template is not" in error["message"]
    assert pools_all_free(disagg, {"prefill", "decode"})


@pytest.mark.slow
def test_tokenize_gives_the_ids_a_request_would_get_and_detokenize_reverses_it(disagg, tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"messages": PREFILLED[:1], "tools": tools, "chat_template_kwargs": {"unused": 1}}
    status, out = http(disagg, "/tokenize", {"model": MODEL, **chat, "return_token_strs": True})
    assert status == 200, out
    out = json.loads(out)
    status, served = http(disagg, "/v1/chat/completions", {"model": MODEL, **chat, "max_tokens": 1})
    assert status == 200 and json.loads(served)["usage"]["prompt_tokens"] == out["count"] == len(out["tokens"])
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"]) and out["max_model_len"] > 0
    status, text = http(disagg, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and "# Tools" in json.loads(text)["prompt"]
    for fields in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
        status, plain = http(disagg, "/tokenize", {"prompt": "Once upon a time", **fields})
        assert status == 200 and json.loads(plain)["tokens"] == tokenizer.encode("Once upon a time")
    status, documented = http(disagg, "/tokenize", {**chat, "documents": [{"title": "t", "text": "x"}],
                                                    "add_special_tokens": True})
    assert status == 200 and json.loads(documented)["tokens"] == out["tokens"]   # no BOS, no documents: the same
    for path, body, code, words in (
            ("/tokenize", {"prompt": "x", "messages": PREFILLED}, 400, "exactly one"),
            ("/tokenize", {"prompt": "x", "tools": tools}, 400, "go with messages"),
            ("/tokenize", {"messages": PREFILLED, "tool_choice": "required"}, 400, "needs tools"),
            ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
            ("/detokenize", {"tokens": [len(tokenizer)]}, 400, "out of range")):
        status, text = http(disagg, path, body)
        assert status == code and words in json.loads(text)["error"]["message"], (path, body, text)
