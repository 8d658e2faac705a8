"""Local prefill (`routing.local_prefill_tokens`, its default): a decode replica whose prefix cache
holds a prompt's beginning and all but a few of its tokens computes them itself, with no prefill
replica and no KV hand-off; a prompt new to it, or a longer remainder, goes through the prefill pool.

One tiny app of 1 prefill + 1 decode replica. A conversation's first turn (nothing cached) is handed
off; its next turn (the first turn's prompt, the reply's tokens and a short message) finds the
decode replica holding the first turn's blocks and is prefilled there: the decode replica's
counter of local prefills goes up, no K/V lands, nothing reaches the prefill pool, the router's
SLO window counts it, and the output is Hugging Face `generate`'s (greedy, fp32) streamed or not.
A fresh short prompt is handed off too; the second choice of an `n` = 2 request, which finds the
first one's blocks, is not. A client that leaves a local prefill's stream leaves every block free.
"""

import json

import pytest
import torch
from ray import serve
from transformers import AutoModelForCausalLM

from serving.config import RoutingOptions
from serving.slo_autoscaling import LOCAL_RATE, LOCAL_TOKENS
from service_util import http, leave_at_first_token, metrics, pools_all_free, sse_events, tiny_app, wait_until

pytestmark = pytest.mark.slow
LIMIT = RoutingOptions().local_prefill_tokens
BLOCK = 16                                  # the engine's default block size


@pytest.fixture(scope="module")
def app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "lp", routing={"local_prefill_tokens": LIMIT}) as base:
        yield base


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def greedy(prompt: list[int], n: int) -> list[int]:
        x = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()
    return greedy


def counts(base: str) -> dict[str, float]:
    """The decode pool's local prefills and landed hand-offs, the prefill pool's prompt tokens looked up."""
    m = metrics(base)

    def total(name, pool):
        return sum(v for (n, p, _), v in m.items() if n == name and p == pool)
    return {"local": total("pdserve_prefills_local", "decode"),
            "landed": total("pdserve_kv_transfers_landed", "decode"),
            "prefilled": total("pdserve_prefix_cache_query_tokens", "prefill")}


def settled(base: str, expected: dict[str, float]) -> dict[str, float]:
    """The counters once they reach `expected` (replicas push them every 0.5 s), else as they are."""
    wait_until(lambda: counts(base) == expected, 15)
    return counts(base)


def completion(base: str, prompt: list[int], n_tokens: int, stream: bool = False, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, text = http(base, "/v1/completions", body)
    assert status == 200, text
    if not stream:
        return json.loads(text)
    events = sse_events(text)
    assert events.pop() == "[DONE]"
    ids = [t for e in events for c in e.get("choices") or () for t in c.get("token_ids") or ()]
    usage = next(e["usage"] for e in events if e.get("usage"))
    return {"choices": [{"token_ids": ids}], "usage": usage}


def test_a_conversations_next_turn_is_prefilled_in_the_decode_replica(app, hf_greedy):
    start = counts(app)
    turn1 = list(range(100, 100 + LIMIT + 40))                  # nothing cached, longer than the limit
    first = completion(app, turn1, 12)
    reply = first["choices"][0]["token_ids"]
    assert reply == hf_greedy(turn1, 12)
    after1 = {**start, "landed": start["landed"] + 1, "prefilled": start["prefilled"] + len(turn1)}
    assert settled(app, after1) == after1

    turn2 = turn1 + reply + list(range(300, 330))
    held = (len(turn1) + len(reply) - 1) // BLOCK * BLOCK         # the decode replica's full computed blocks
    assert len(turn2) - held <= LIMIT < len(turn2)
    for i, stream in enumerate((True, False)):
        second = completion(app, turn2, 10, stream=stream)
        assert second["choices"][0]["token_ids"] == hf_greedy(turn2, 10)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= held
        expected = {**after1, "local": after1["local"] + i + 1}   # no hand-off, nothing in the prefill pool
        assert settled(app, expected) == expected
    assert pools_all_free(app, {"prefill", "decode"})
    # the SLO policy's view: the router's window counts both local prefills and what they computed
    window = serve.get_deployment_handle("Router", "lp").record_autoscaling_stats.remote().result()
    assert window[LOCAL_RATE] > 0 and 0 < window[LOCAL_TOKENS] <= len(turn2) - held


def test_a_new_prompt_is_handed_off_and_its_second_choice_is_prefilled_there(app, hf_greedy):
    start = counts(app)
    short = list(range(500, 520))                                # shorter than the limit, but new here
    both = completion(app, short, 8, n=2)
    assert [c["token_ids"] for c in sorted(both["choices"], key=lambda c: c["index"])] == [hf_greedy(short, 8)] * 2
    expected = {"local": start["local"] + 1, "landed": start["landed"] + 1, "prefilled": start["prefilled"] + 20}
    assert settled(app, expected) == expected
    assert pools_all_free(app, {"prefill", "decode"})


def test_a_client_leaving_a_local_prefill_frees_every_block(app):
    start = counts(app)
    prompt = list(range(700, 730))
    completion(app, prompt, 4)                                   # its first block is held there now
    leave_at_first_token(app, {"model": "tiny", "prompt": prompt + [5, 6], "max_tokens": 1500,
                               "ignore_eos": True, "stream": True})
    assert wait_until(lambda: counts(app)["local"] == start["local"] + 1, 15)
    assert pools_all_free(app, {"prefill", "decode"})
