"""OpenAI logprobs objects built by the router (router/logprobs.py) with the default model's
byte-level tokenizer: exact bytes for characters split across tokens, running text offsets, vLLM's
tokens as `token_id:{id}`."""

import pytest
from transformers import AutoTokenizer

from engine.outputs import TokenLogprobs
from router.logprobs import LogprobsFormatter, TokenStrings, vllm_prompt_logprobs


@pytest.fixture(scope="module")
def strings(default_model_dir):
    return TokenStrings(AutoTokenizer.from_pretrained(default_model_dir))


def test_token_bytes_rebuild_the_text_even_when_a_character_is_split(strings):
    text = "Voilà: 🙂 東京 naïve"
    ids = strings.tokenizer.encode(text)
    parts = [strings(t) for t in ids]
    assert any("\ufffd" in s for s, _ in parts), "no character split across tokens: the test sees nothing"
    assert bytes(b for _, data in parts for b in data).decode("utf-8") == text


def test_completion_and_chat_objects(strings):
    ids = strings.tokenizer.encode("Hello there, world")
    entries = tuple(TokenLogprobs(t, -0.5 * k, ((t, -0.5 * k), (ids[0], -3.0))) for k, t in enumerate(ids))
    fmt = LogprobsFormatter(strings)
    first, rest = fmt.completion(entries[:1]), fmt.completion(entries[1:])
    tokens = first["tokens"] + rest["tokens"]
    assert "".join(tokens) == "Hello there, world"
    assert first["text_offset"] + rest["text_offset"] == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert first["token_logprobs"] + rest["token_logprobs"] == [e.logprob for e in entries]
    assert rest["top_logprobs"][0] == {tokens[1]: -0.5, tokens[0]: -3.0}
    chat = LogprobsFormatter(strings).chat(entries[:2])
    assert chat["refusal"] is None and len(chat["content"]) == 2
    item = chat["content"][1]
    assert item["token"] == tokens[1] and item["logprob"] == -0.5
    assert bytes(item["bytes"]).decode() == tokens[1]
    assert [t["token"] for t in item["top_logprobs"]] == [tokens[1], tokens[0]]
    assert item["top_logprobs"][1] == {"token": tokens[0], "logprob": -3.0, "bytes": list(tokens[0].encode())}


def test_tokens_as_token_ids_show_each_token_by_its_id_with_offsets_still_in_the_text(strings):
    """vLLM's return_tokens_as_token_ids: `token_id:{id}` for the token and its alternatives (their
    bytes that string's); text offsets count the text the tokens write."""
    ids = strings.tokenizer.encode("Hello there")
    entries = tuple(TokenLogprobs(t, -0.5, ((t, -0.5), (ids[0], -3.0))) for t in ids)
    got = LogprobsFormatter(strings, as_ids=True).completion(entries)
    assert got["tokens"] == [f"token_id:{t}" for t in ids]
    assert got["text_offset"] == [sum(len(strings(t)[0]) for t in ids[:k]) for k in range(len(ids))]
    assert got["top_logprobs"][1] == {f"token_id:{ids[1]}": -0.5, f"token_id:{ids[0]}": -3.0}
    item = LogprobsFormatter(strings, as_ids=True).chat(entries[1:2])["content"][0]
    assert item["token"] == f"token_id:{ids[1]}" and bytes(item["bytes"]).decode() == item["token"]
    assert [t["token"] for t in item["top_logprobs"]] == [f"token_id:{ids[1]}", f"token_id:{ids[0]}"]


def test_echo_puts_the_prompt_first_with_no_logprob_for_its_first_token(strings):
    prompt = strings.tokenizer.encode("The sky is")
    prompt_entries = tuple(TokenLogprobs(t, -1.0 - k, ((t, -1.0 - k),)) for k, t in enumerate(prompt[1:]))
    out_id = strings.tokenizer.encode(" blue")[0]
    fmt = LogprobsFormatter(strings)
    got = fmt.completion((TokenLogprobs(out_id, -0.25, ((out_id, -0.25),)),), prompt=(prompt, prompt_entries))
    assert "".join(got["tokens"]) == "The sky is" + strings(out_id)[0]
    assert got["token_logprobs"] == [None] + [-1.0 - k for k in range(len(prompt) - 1)] + [-0.25]
    assert got["top_logprobs"][0] is None and got["top_logprobs"][1] == {got["tokens"][1]: -1.0}
    assert got["text_offset"][:2] == [0, len(got["tokens"][0])]
    assert fmt.offset == len("".join(got["tokens"]))


def test_vllm_prompt_logprobs_list_the_prompt_token_first_then_the_likeliest_with_their_ranks(strings):
    prompt = strings.tokenizer.encode("The sky is blue")
    a, b = prompt[1], prompt[2]
    entries = (TokenLogprobs(a, -0.1, ((a, -0.1), (b, -2.5)), 1),          # the likeliest itself
               TokenLogprobs(b, -4.0, ((a, -0.3), (7, -1.9)), 9))
    got = vllm_prompt_logprobs(strings, entries, 2)
    assert got[0] is None and len(got) == 3
    assert got[1] == {str(a): {"logprob": -0.1, "rank": 1, "decoded_token": strings(a)[0]},
                      str(b): {"logprob": -2.5, "rank": 2, "decoded_token": strings(b)[0]}}
    assert list(got[2]) == [str(b), str(a), "7"]                         # the prompt token first
    assert got[2][str(b)]["rank"] == 9 and got[2]["7"] == {"logprob": -1.9, "rank": 2, "decoded_token": strings(7)[0]}
    assert vllm_prompt_logprobs(strings, entries, 0) == [None, {str(a): got[1][str(a)]}, {str(b): got[2][str(b)]}]
    assert vllm_prompt_logprobs(strings, (), 3) == [None]                  # a one-token prompt


def test_an_echoed_prompt_shows_no_more_alternatives_than_logprobs_asks(strings):
    """prompt_logprobs 2 beside echo with logprobs 1: the engine computed two alternatives a token."""
    prompt = strings.tokenizer.encode("The sky is")
    entries = tuple(TokenLogprobs(t, -1.0, ((t, -1.0), (5, -2.0)), 1) for t in prompt[1:])
    got = LogprobsFormatter(strings, 1).completion((), prompt=(prompt, entries))
    assert got["top_logprobs"][1:] == [{strings(t)[0]: -1.0} for t in prompt[1:]]
