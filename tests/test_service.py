"""End to end on a local Ray cluster: router -> prefill pool -> KV over gloo -> decode pool.

One disaggregated app (1 prefill, 2 decode replicas) and one colocated app share the
session's Ray cluster. Greedy HTTP output is compared token for token with Hugging Face
`generate` (default model, fp32).
"""

import http.client as httpclient
import json
import re
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_prompts import max_tokens_for
from service_util import CORS_ORIGIN, http, metrics, pools_all_free, ray_metrics_url, sse_events, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir)


def complete(base, ids, i, stream=False):
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens_for(i), "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, text = http(base, "/v1/completions", body)
    assert status == 200, text
    if not stream:
        out = json.loads(text)
        return out["choices"][0]["text"], out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    usage = events[-2]["usage"]
    return "".join(c["choices"][0]["text"] for c in chunks), usage["completion_tokens"], \
        chunks[-1]["choices"][0]["finish_reason"]


def expected(tokenizer, hf_tokens, i):
    finish = "stop" if hf_tokens[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(hf_tokens, skip_special_tokens=True), len(hf_tokens), finish


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_http_matches_hf(disagg, prompts, hf_greedy, tokenizer, stream):
    for i in (0, 3, 12, 15):
        assert complete(disagg, prompts[i], i, stream) == expected(tokenizer, hf_greedy[i], i)
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_sixteen_concurrent_mixed_requests(disagg, prompts, hf_greedy, tokenizer):
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: complete(disagg, prompts[i], i, stream=i % 2 == 1), range(16)))
    assert results == [expected(tokenizer, hf_greedy[i], i) for i in range(16)]
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_both_decode_replicas_used_and_kv_goes_to_the_decoding_replica(disagg, prompts):
    # counted over this test's requests only: the app is shared, and an earlier test's client that
    # left while its KV was on the wire counts a transfer sent that no request took up
    assert pools_all_free(disagg, {"prefill", "decode"})
    before = metrics(disagg)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: complete(disagg, prompts[i % 16], i % 16), range(24)))
    handed_off = sum(1 for _, tokens, _ in results if tokens > 1)   # one token ends at the prefill

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    def settled() -> bool:   # each replica reports its counters every STATS_PERIOD_S
        nonlocal after
        after = metrics(disagg)
        return sum(delta(k) for k in after if k[0] in ("pdserve_kv_transfers_sent", "pdserve_kv_transfers_landed",
                                                         "pdserve_requests_decoded")) == 3 * handed_off
    after: dict = {}
    assert wait_until(settled, 10), after

    decode = {r for (n, p, r) in after if p == "decode" and n == "pdserve_kv_blocks_total"}
    assert len(decode) == 2
    for r in decode:
        decoded = delta(("pdserve_requests_decoded", "decode", r))
        assert decoded > 0, f"decode replica {r} got no request"
        # a replica only decodes requests whose KV landed in its own pool
        assert delta(("pdserve_kv_transfers_landed", "decode", r)) == decoded
    landed = sum(delta(("pdserve_kv_transfers_landed", "decode", r)) for r in decode)
    sent = sum(delta(k) for k in after if k[0] == "pdserve_kv_transfers_sent")
    assert sent == landed == handed_off > 0


def test_openai_client(disagg):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=disagg + "/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=12, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=12, temperature=0,
        stream=True) if c.choices)
    assert text == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.total_tokens == comp.usage.prompt_tokens + 8
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_frees_everything(disagg, n):
    """Also with n = 3 choices streaming at once: every one of them is aborted in its pools."""
    host, port = disagg.split("//")[1].split("/")[0].split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True, "n": n}
    conn.request("POST", "/pd/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    try:
        resp = conn.getresponse()
        assert resp.status == 200
        for _ in range(5):
            assert resp.fp.readline()

        def decoding():
            return sum(v for (name, pool, _), v in metrics(disagg).items()
                       if name == "pdserve_running_requests" and pool == "decode") >= n
        assert wait_until(decoding, 15), "the streaming choices never all showed up as running"
    finally:
        conn.sock.close()
        conn.close()
    assert pools_all_free(disagg, {"prefill", "decode"})
    m = metrics(disagg)
    assert all(v == 0 for (name, _, _), v in m.items() if name == "pdserve_running_requests")


def test_colocated_mode_matches_hf(colocated, prompts, hf_greedy, tokenizer):
    for i in (1, 4, 13):
        assert complete(colocated, prompts[i], i, stream=i % 2 == 0) == expected(tokenizer, hf_greedy[i], i)
    assert pools_all_free(colocated, {"colocated"})


def _logprobs_run(base, path, body, stream):
    """(text, completion_tokens, the choice's logprobs entries) of one request; streamed chunks'
    entries are concatenated."""
    status, text = http(base, path, {**body, "stream": stream, "stream_options": {"include_usage": True}}
                        if stream else body)
    assert status == 200, text
    key = "content" if "messages" in body else "tokens"
    if not stream:
        out = json.loads(text)
        choice = out["choices"][0]
        return choice.get("text") or choice["message"]["content"], out["usage"]["completion_tokens"], \
            choice["logprobs"]
    events = sse_events(text)
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    merged = {}
    for c in chunks:
        for k, v in (c["logprobs"] or {}).items():
            if isinstance(v, list):
                merged.setdefault(k, []).extend(v)
    assert key in merged
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in chunks), \
        events[-2]["usage"]["completion_tokens"], merged


def test_logprobs_over_http_agree_across_streaming_and_modes(disagg, colocated):
    """Completions (logprobs=3) and chat (top_logprobs=2), greedy: one entry per output token,
    the first from the prefill replica and the rest from the decode replica, the chosen token
    the most likely one; streamed and whole answers and the colocated mode agree."""
    body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0,
            "logprobs": 3}
    text, n, lp = _logprobs_run(disagg, "/v1/completions", body, stream=False)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]).startswith(text) and n == 12
    for chosen, lp_k, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert lp_k <= 0 and top[chosen] == lp_k and lp_k == pytest.approx(max(top.values()))
        assert 3 <= len(top) <= 4
    for base, stream in ((disagg, True), (colocated, False), (colocated, True)):
        text2, n2, lp2 = _logprobs_run(base, "/v1/completions", body, stream)
        assert (text2, n2, lp2["tokens"]) == (text, n, lp["tokens"])
        assert lp2["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-3)
        assert lp2["text_offset"] == lp["text_offset"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    text, n, lp = _logprobs_run(disagg, "/v1/chat/completions", chat, stream=False)
    assert len(lp["content"]) == n and all(len(item["top_logprobs"]) == 2 for item in lp["content"])
    assert "".join(item["token"] for item in lp["content"]).startswith(text)
    _, n2, lp2 = _logprobs_run(disagg, "/v1/chat/completions", chat, stream=True)
    assert n2 == n and [i["token"] for i in lp2["content"]] == [i["token"] for i in lp["content"]]
    status, text = http(disagg, "/v1/completions", {**body, "logprobs": None})
    assert status == 200 and json.loads(text)["choices"][0]["logprobs"] is None
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_penalties_reach_both_pools(disagg, colocated):
    """The decode replica must apply the penalties over the prompt and every output token
    (the first one came from the prefill replica): the split answer equals one engine's."""
    body = {"model": MODEL, "prompt": "one two one two one two one two", "max_tokens": 20, "temperature": 0}
    penalized = {**body, "frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    plain = json.loads(http(disagg, "/v1/completions", body)[1])["choices"][0]["text"]
    split = json.loads(http(disagg, "/v1/completions", penalized)[1])["choices"][0]["text"]
    single = json.loads(http(colocated, "/v1/completions", penalized)[1])["choices"][0]["text"]
    assert split == single and split != plain


def test_min_p_and_stop_token_ids_reach_the_engines(disagg, colocated, tokenizer):
    """vLLM's min_p and stop_token_ids through both pools: min_p 1 keeps only the likeliest token,
    so a sampled completion is the greedy one; a stop token ends the output at its first
    occurrence with finish_reason stop, its text left out unless include_stop_str_in_output (as
    vLLM), split as in one engine."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "ignore_eos": True}
    greedy = json.loads(http(disagg, "/v1/completions", {**body, "temperature": 0})[1])["choices"][0]
    sampled = json.loads(http(disagg, "/v1/completions", {**body, "temperature": 1.5, "min_p": 1.0,
                                                         "seed": 11})[1])["choices"][0]
    assert sampled["text"] == greedy["text"]
    ids = tokenizer.encode(greedy["text"], add_special_tokens=False)
    stop_at = ids[3]
    for base in (disagg, colocated):
        for include in (False, True):
            status, text = http(base, "/v1/completions", {"model": MODEL, "prompt": body["prompt"], "max_tokens": 10,
                                                         "temperature": 0, "stop_token_ids": [stop_at],
                                                         "include_stop_str_in_output": include})
            choice = json.loads(text)["choices"][0]
            assert status == 200 and choice["finish_reason"] == "stop", text
            assert tokenizer.encode(choice["text"], add_special_tokens=False) == ids[:ids.index(stop_at) + include]


def test_vllm_s_text_and_prompt_options_cross_both_pools(disagg, colocated, tokenizer):
    """allowed_token_ids, skip_special_tokens, include_stop_str_in_output and bad_words reach the decode pool (the
    prefill pool samples only the first token); truncate_prompt_tokens keeps the prompt's last tokens
    (truncation_side right: its first; usage and echo show the kept ones, chat's after the template);
    return_token_ids gives the prompt's and the output's token ids, the streamed chunks' adding up to the whole
    answer's, and return_tokens_as_token_ids shows the logprobs' tokens by those ids; a cache_salt's prompts
    find cached prefixes only of the same salt; stop_reason names the stop string that ended a choice;
    request_id names the answer."""
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for base in (disagg, colocated):
        texts = []
        for skip in (True, False):
            status, text = http(base, "/v1/completions", {**body, "allowed_token_ids": [im_start], "logprobs": 0,
                                                         "skip_special_tokens": skip})
            assert status == 200, text
            choice = json.loads(text)["choices"][0]
            assert choice["logprobs"]["tokens"] == ["<|im_start|>"] * 6, choice
            texts.append(choice["text"])
        assert texts == ["", "<|im_start|>" * 6]
        greedy = json.loads(http(base, "/v1/completions", body)[1])["choices"][0]["text"]
        stop = greedy[3:6]
        ended = {include: json.loads(http(base, "/v1/completions", {**body, "stop": [stop, "zzz"],
                                                                     "include_stop_str_in_output": include})[1])
                 for include in (False, True)}
        cut = {include: out["choices"][0]["text"] for include, out in ended.items()}
        assert [out["choices"][0]["stop_reason"] for out in ended.values()] == [stop, stop]   # vLLM's
        # a stop string first seen after the first token's text: the decode side's (disaggregated)
        head = len(json.loads(http(base, "/v1/completions", {**body, "max_tokens": 1})[1])["choices"][0]["text"])
        late = next(greedy[k:k + 2] for k in range(head, len(greedy) - 1) if greedy.index(greedy[k:k + 2]) == k)
        out = json.loads(http(base, "/v1/completions", {**body, "stop": [late]})[1])["choices"][0]
        assert out["stop_reason"] == late and out["finish_reason"] == "stop"
        assert out["text"] == greedy[:greedy.index(late)]
        assert cut == {False: greedy[:greedy.index(stop)], True: greedy[:greedy.index(stop) + len(stop)]}
        word = greedy.split()[0]          # the first token's (the prefill replica's) and later ones
        unsaid = [json.loads(http(base, "/v1/completions", {**body, "max_tokens": 12, "bad_words": [w]})[1])
                  for w in (word, greedy.split()[1])]
        assert [word not in unsaid[0]["choices"][0]["text"], greedy.split()[1] not in unsaid[1]["choices"][0]["text"]
                ] == [True, True], (greedy, unsaid)
    ids = tokenizer.encode("Once upon a time, in a land far away, there lived a king")
    out = json.loads(http(disagg, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 5})[1])
    alone = json.loads(http(disagg, "/v1/completions", {**body, "prompt": ids[-5:]})[1])
    assert out["usage"]["prompt_tokens"] == 5 and out["choices"][0]["text"] == alone["choices"][0]["text"]
    echoed = json.loads(http(disagg, "/v1/completions", {**body, "prompt": "Once upon a time, in a land far away",
                                                         "truncate_prompt_tokens": 3, "echo": True})[1])
    kept = tokenizer.decode(tokenizer.encode("Once upon a time, in a land far away")[-3:])
    assert echoed["choices"][0]["text"].startswith(kept) and not echoed["choices"][0]["text"].startswith("Once")
    head = json.loads(http(disagg, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 5,
                                                       "truncation_side": "right", "echo": True})[1])
    first = json.loads(http(disagg, "/v1/completions", {**body, "prompt": ids[:5], "echo": True})[1])
    assert head["usage"]["prompt_tokens"] == 5 and head["choices"][0]["text"] == first["choices"][0]["text"]
    assert head["choices"][0]["text"].startswith(tokenizer.decode(ids[:5]))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
            "max_tokens": 3}
    whole = json.loads(http(disagg, "/v1/chat/completions", chat)[1])["usage"]["prompt_tokens"]
    for k, expected_len in ((4, 4), (-1, whole), (10**6, whole)):
        cut = json.loads(http(disagg, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": k})[1])
        assert cut["usage"]["prompt_tokens"] == expected_len, (k, cut)
    # request_id names the answer, else the X-Request-Id header (a client's, or the one Serve's proxy gives
    # each request and logs); two requests naming the same id both run (the pools' ids stay their own);
    # add_special_tokens false: this tokenizer adds none anyway
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        named = list(pool.map(lambda _: http(disagg, "/v1/completions", {**body, "request_id": "job-42"}), range(2)))
    assert [(status, json.loads(text)["id"]) for status, text in named] == [(200, "cmpl-job-42")] * 2
    assert {json.loads(text)["choices"][0]["text"] for _, text in named} == {greedy}
    traced = sse_events(http(disagg, "/v1/chat/completions", {**chat, "stream": True},
                             headers={"X-Request-Id": "trace-9"})[1])[:-1]
    assert traced and {e["id"] for e in traced} == {"chatcmpl-trace-9"}
    unmarked = json.loads(http(disagg, "/v1/completions", {**body, "add_special_tokens": False})[1])
    assert unmarked["choices"][0]["text"] == greedy
    assert re.fullmatch(r"cmpl-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", unmarked["id"]), unmarked["id"]   # Serve's
    asked = {**body, "return_token_ids": True}
    out = json.loads(http(disagg, "/v1/completions", asked)[1])["choices"][0]
    assert out["prompt_token_ids"] == tokenizer.encode(prompt) and len(out["token_ids"]) == 6
    assert tokenizer.decode(out["token_ids"]) == out["text"]
    by_id = json.loads(http(disagg, "/v1/completions", {**asked, "logprobs": 0, "return_tokens_as_token_ids": True})[1])
    assert by_id["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    streamed = [e["choices"][0] for e in sse_events(http(disagg, "/v1/completions", {**asked, "stream": True})[1])[:-1]]
    assert streamed[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert sum((c["token_ids"] for c in streamed), []) == out["token_ids"]
    story = {**body, "prompt": "A salted prompt about the lighthouse keeper, the gulls and the sea, told twice. " * 3}
    cached = {}
    for salt in ("tenant-1", "tenant-2", "tenant-1"):
        use = json.loads(http(disagg, "/v1/completions", {**story, "cache_salt": salt})[1])["usage"]
        cached.setdefault(salt, []).append(use["prompt_tokens_details"]["cached_tokens"])
    assert cached["tenant-1"][0] == 0 and cached["tenant-2"] == [0] and cached["tenant-1"][1] > 0, cached
    answer = json.loads(http(disagg, "/v1/chat/completions", {**chat, "temperature": 0, "return_token_ids": True})[1])
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"] == whole
    assert tokenizer.decode(answer["choices"][0]["token_ids"]) == answer["choices"][0]["message"]["content"]
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_n_choices_share_the_prompt_and_have_their_own_seeds(disagg):
    """n = 3 sampled choices with a seed: choice i draws what a single request with seed + i
    draws; choices 1 and 2 reuse choice 0's prompt blocks from the prefill replica's prefix cache;
    usage counts the prompt once and every choice's tokens; streamed, each choice's chunks carry
    its index and add up to the same texts."""
    prompt = "Here is a short story about a lighthouse keeper and the sea. " * 4
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3,
            "ignore_eos": True}
    status, text = http(disagg, "/v1/completions", body)
    assert status == 200, text
    out = json.loads(text)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in out["choices"]]
    assert len(set(texts)) > 1
    for i in range(3):
        single = json.loads(http(disagg, "/v1/completions", {**body, "n": 1, "seed": 7 + i})[1])
        assert single["choices"][0]["text"] == texts[i]
    use = out["usage"]
    assert use["completion_tokens"] == 18 and use["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert use["prompt_tokens_details"]["cached_tokens"] >= 16 * (use["prompt_tokens"] // 16 - 1)
    status, text = http(disagg, "/v1/completions", {**body, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]"
    streamed = ["", "", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == texts and events[-2]["usage"]["completion_tokens"] == 18
    # vLLM's continuous_usage_stats: every chunk with the usage so far, counting up to the whole
    status, text = http(disagg, "/v1/completions", {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(text)[:-1]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert status == 200 and all(e["usage"]["prompt_tokens"] == use["prompt_tokens"] for e in events)
    assert counts == sorted(counts) and counts[0] < counts[-1] == 18 and not events[-1]["choices"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "temperature": 0, "n": 2}
    out = json.loads(http(disagg, "/v1/chat/completions", chat)[1])
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["message"] == out["choices"][1]["message"]      # greedy: the same
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_batched_prompts_with_n(disagg, prompts, hf_greedy, tokenizer):
    """A completion with two token prompts and n = 2, greedy: choices 2p and 2p + 1 are prompt
    p's and equal Hugging Face's output for it; streamed the same; usage counts both prompts."""
    k = min(max_tokens_for(1), max_tokens_for(4))
    body = {"model": MODEL, "prompt": [prompts[1], prompts[4]], "max_tokens": k, "temperature": 0, "n": 2}
    refs = [tokenizer.decode(hf_greedy[i][:k], skip_special_tokens=True) for i in (1, 4)]
    status, text = http(disagg, "/v1/completions", body)
    assert status == 200, text
    out = json.loads(text)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [refs[0], refs[0], refs[1], refs[1]]
    assert out["usage"]["prompt_tokens"] == len(prompts[1]) + len(prompts[4])
    events = sse_events(http(disagg, "/v1/completions", {**body, "stream": True})[1])
    streamed = [""] * 4
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == [c["text"] for c in out["choices"]]
    status, text = http(disagg, "/v1/completions", {"model": MODEL, "prompt": ["Hello", "The sky is"],
                                                    "max_tokens": 3, "temperature": 0})
    assert status == 200 and len(json.loads(text)["choices"]) == 2
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_echo_with_prompt_logprobs_as_evaluation_harnesses_ask(disagg, colocated, tokenizer):
    """`echo` + `logprobs` + `max_tokens` 1 over a batch of token prompts (what lm-eval's
    loglikelihood requests send): each choice's text starts with its prompt, its logprobs list
    every prompt token (the first with none) and the generated one; the prompt's logprobs come
    from the prefill replica, equal the colocated engine's and do not depend on the prefix cache."""
    prompts = [tokenizer.encode("The capital of France is Paris"), tokenizer.encode("Two plus two is four")]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    runs = []
    for base in (disagg, disagg, colocated):     # the second time the prompts are cached
        status, text = http(base, "/v1/completions", body)
        assert status == 200, text
        runs.append(json.loads(text))
    for out in runs:
        for p, choice in zip(prompts, out["choices"]):
            lp = choice["logprobs"]
            assert choice["text"].startswith(tokenizer.decode(p)) and len(lp["tokens"]) == len(p) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert all(v <= 0 for v in lp["token_logprobs"][1:])
            assert "".join(lp["tokens"][:len(p)]) == tokenizer.decode(p)
        assert out["usage"]["completion_tokens"] == 2
    for out in runs[1:]:
        for a, b in zip(runs[0]["choices"], out["choices"]):
            assert b["logprobs"]["token_logprobs"][1:] == pytest.approx(a["logprobs"]["token_logprobs"][1:], abs=1e-3)
    events = sse_events(http(disagg, "/v1/completions", {**body, "prompt": prompts[0], "stream": True})[1])
    chunks = [e["choices"][0] for e in events[:-1] if e.get("choices")]
    assert "".join(c["text"] for c in chunks) == runs[0]["choices"][0]["text"]
    streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(
        runs[0]["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-3)
    plain = json.loads(http(disagg, "/v1/completions", {**body, "logprobs": None, "prompt": "Hello there"})[1])
    assert plain["choices"][0]["text"].startswith("Hello there") and plain["choices"][0]["logprobs"] is None
    # max_tokens 0 with echo: the prompt alone, as scoring clients ask for it
    only = json.loads(http(disagg, "/v1/completions", {**body, "max_tokens": 0})[1])
    for p, choice, ref in zip(prompts, only["choices"], runs[0]["choices"]):
        assert choice["text"] == tokenizer.decode(p) and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == ref["logprobs"]["tokens"][:len(p)]
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            ref["logprobs"]["token_logprobs"][1:len(p)], abs=1e-3)
    assert only["usage"]["completion_tokens"] == 0
    # vLLM's prompt_logprobs beside echo: the same numbers with each token's rank and 2 alternatives (echo's
    # logprobs still show 1); in either mode; chat's at the response's top level
    for base in (disagg, colocated):
        both = json.loads(http(base, "/v1/completions", {**body, "prompt_logprobs": 2})[1])
        for p, choice, ref in zip(prompts, both["choices"], runs[0]["choices"]):
            assert choice["logprobs"]["top_logprobs"] == ref["logprobs"]["top_logprobs"]
            listed = choice["prompt_logprobs"]
            assert listed[0] is None and len(listed) == len(p)
            for k, entry in enumerate(listed[1:], 1):
                own = entry[str(p[k])]
                assert own["logprob"] == pytest.approx(ref["logprobs"]["token_logprobs"][k], abs=1e-3)
                assert own["decoded_token"] == ref["logprobs"]["tokens"][k]
                likeliest = max(ref["logprobs"]["top_logprobs"][k].values())
                assert own["rank"] > 1 or likeliest == pytest.approx(own["logprob"], abs=1e-3)
                assert own["rank"] == 1 or likeliest > own["logprob"]
                ranks = sorted(v["rank"] for v in entry.values())
                assert ranks[:2] == [1, 2] and len(entry) == (2 if own["rank"] <= 2 else 3), entry
            assert any(entry[str(t)]["rank"] > 1 for entry, t in zip(listed[1:], p[1:]))
    chat = json.loads(http(colocated, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                               "messages": [{"role": "user", "content": "Hi"}]})[1])
    listed = chat["prompt_logprobs"]
    assert len(listed) == chat["usage"]["prompt_tokens"] and listed[0] is None and all(len(e) == 1 for e in listed[1:])
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})


def test_a_browser_page_of_an_allowed_origin_may_call_the_api(disagg):
    """CORS through Serve's proxy: the preflight is answered, the answer carries the page's origin;
    another origin's preflight is refused and its answers carry none (the browser withholds them)."""

    def call(method, path, origin, body=None, headers=()):
        req = urllib.request.Request(disagg + path, data=body, method=method,
                                     headers={"Origin": origin, "Content-Type": "application/json", **dict(headers)})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = call("OPTIONS", "/v1/completions", CORS_ORIGIN, headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == CORS_ORIGIN, headers
    assert "POST" in headers["access-control-allow-methods"]
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    status, headers, text = call("POST", "/v1/completions", CORS_ORIGIN, body)
    assert status == 200 and headers["access-control-allow-origin"] == CORS_ORIGIN
    assert json.loads(text)["choices"][0]["text"]
    other = "https://elsewhere.example"
    status, headers, _ = call("OPTIONS", "/v1/completions", other, headers=preflight)
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = call("POST", "/v1/completions", other, body)
    assert status == 200 and "access-control-allow-origin" not in headers


def test_health_models_and_errors(disagg):
    assert http(disagg, "/health")[0] == 200
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    assert http(disagg, "/v1/completions", body)[0] == 200      # so that the latency series have a sample
    _, text = http(disagg, "/metrics")
    count = float(re.search(r"^pdserve_ttft_seconds_count (\S+)$", text, re.M).group(1))
    assert count > 0 and "pdserve_tpot_seconds_bucket" in text
    status, text = http(disagg, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == MODEL
    status, text = http(disagg, "/v1/completions", raw=b"{not json")
    assert status == 400 and "error" in json.loads(text)
    status, text = http(disagg, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"
    status, text = http(disagg, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400
    status, text = http(disagg, "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 7})
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"


def _sample(text: str, series: str) -> float:
    """The value of one exact series line (`name` or `name{labels}`) of /metrics text; 0 if absent."""
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_queue_prefill_and_kv_transfer_series(disagg):
    _, before = http(disagg, "/metrics")
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    for _ in range(3):
        assert http(disagg, "/v1/completions", body)[0] == 200
    _, text = http(disagg, "/metrics")
    for name in ("pdserve_queue_seconds", "pdserve_prefill_seconds"):
        assert f"# TYPE {name} histogram" in text
        assert _sample(text, f"{name}_count") - _sample(before, f"{name}_count") == 3
        assert _sample(text, f'{name}_bucket{{le="+Inf"}}') == _sample(text, f"{name}_count")
    assert _sample(text, "pdserve_prefill_seconds_sum") > _sample(before, "pdserve_prefill_seconds_sum")
    assert _sample(text, "pdserve_router_ray_metrics_errors_total") == 0

    def pushed():   # the prefill replica reports its transfer histograms with its next stats push
        m = metrics(disagg)
        counts = [v for (n, p, _), v in m.items() if n == "pdserve_kv_transfer_seconds_count" and p == "prefill"]
        return counts and sum(counts) == sum(v for (n, _, _), v in m.items() if n == "pdserve_kv_transfers_sent")
    assert wait_until(pushed, 10), "the KV transfer histograms never matched the transfers sent"
    m = metrics(disagg)
    assert sum(v for (n, _, _), v in m.items() if n == "pdserve_kv_transfer_bytes_sum") == \
        sum(v for (n, _, _), v in m.items() if n == "pdserve_kv_bytes_sent") > 0
    errors = {(p, r): v for (n, p, r), v in m.items() if n == "pdserve_ray_metrics_errors"}
    assert {p for p, _ in errors} == {"prefill", "decode"} and not any(errors.values())


def test_the_decode_replicas_speculate_and_say_so(disagg, colocated):
    """The disaggregated fixture's decode pool runs with speculative_tokens 3 (tests/conftest.py):
    a request that repeats its prompt keeps drafts (counted on /metrics) and its output is the
    colocated replica's, which does not speculate."""
    def kept():
        return sum(v for (n, p, _), v in metrics(disagg).items() if n == "pdserve_spec_accepted_tokens" and p == "decode")
    before = kept()
    text = "one apple, two pears, three plums, four figs, five limes, six dates"
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Repeat exactly: {text}"}], "max_tokens": 24,
            "temperature": 0}
    outs = [json.loads(http(base, "/v1/chat/completions", body)[1])["choices"][0] for base in (disagg, colocated)]
    assert outs[0]["message"]["content"] == outs[1]["message"]["content"]
    assert wait_until(lambda: kept() > before, 10), "no draft token was kept (or the stats never came)"
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_ray_metrics_port_has_the_pdserve_series(disagg):
    """Ray's metrics agent exports what the router and replicas record through ray.serve.metrics
    (prefixed `ray_`); skipped where this cluster runs no metrics agent."""
    import urllib.request
    url = ray_metrics_url()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    assert http(disagg, "/v1/completions", body)[0] == 200
    wanted = ("ray_pdserve_ttft_seconds_count", "ray_pdserve_prefill_seconds_count", "ray_pdserve_requests_total",
              "ray_pdserve_kv_blocks_free", "ray_pdserve_running_requests", "ray_pdserve_kv_transfer_seconds_count")

    def exported():
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return all(re.search(rf"^{w}\{{", text, re.M) for w in wanted)
    assert wait_until(exported, 90, every=2), "the pdserve series never reached Ray's metrics port"


def test_a_request_id_comes_back_and_marks_the_request_in_every_replica_s_log(disagg):
    """X-Request-Id (Ray Serve's request id): the client's comes back as the answer's x-request-id,
    streamed or not, refused or not (the OpenAI SDK's `_request_id`), one is made up where the
    client sends none, and the router's, the prefill replica's and the decode replica's log lines
    for the request carry it: an operator follows one id across both pools."""
    import openai
    import ray
    rid = f"trace-{uuid.uuid4().hex}"

    def post(body, headers):
        req = urllib.request.Request(disagg + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    for body, status in ((ok, 200), ({**ok, "stream": True}, 200), ({**ok, "max_tokens": -1}, 400)):
        got, headers, text = post(body, {"X-Request-Id": rid})
        assert (got, headers["x-request-id"]) == (status, rid), text
    got, headers, _ = post(ok, {})
    assert got == 200 and headers["x-request-id"] not in (None, "", rid)
    client = openai.OpenAI(base_url=disagg + "/v1", api_key="unused")
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                       extra_headers={"X-Request-Id": rid + "-sdk"})
    assert answer._request_id == rid + "-sdk"
    # the session's Ray writes each replica's Serve log under its logs directory (no public API names it)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def marked() -> set[str]:
        return {f.name.split("_")[2] for f in logs.glob("replica_pd_*.log") if rid in f.read_text(errors="replace")}
    assert wait_until(lambda: marked() >= {"Router", "PrefillServer", "DecodeServer"}, 30), marked()


def test_the_replicas_own_log_lines_reach_serve_s_replica_logs(disagg):
    """pdserve's loggers write, at INFO, where Serve writes each replica's lines (serving/serve_logging.py):
    the engines' KV pool, the decode replica's KV address."""
    import ray
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def lines(deployment: str) -> str:
        return "".join(f.read_text(errors="replace") for f in logs.glob(f"replica_pd_{deployment}_*.log"))
    assert wait_until(lambda: "KV pool: " in lines("PrefillServer") and "receives KV at" in lines("DecodeServer"), 30)
    assert re.search(r"pd_DecodeServer \w+ .*-- decode replica \S+ receives KV at", lines("DecodeServer"))
