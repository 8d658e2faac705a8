"""Round trip of every wire message, and rejection of bad bytes."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from engine.outputs import TokenLogprobs
from engine.pooling import Pooling
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from serving import messages as m

P = m.WireSamplingParams.of(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, max_tokens=12,
                                           min_tokens=2, stop=("\n\n",), stop_token_ids=(7,), ignore_eos=True, seed=3,
                                           presence_penalty=0.5, frequency_penalty=-0.25,
                                           repetition_penalty=1.2, logprobs=3, prompt_logprobs=1))
P2 = m.WireSamplingParams.of(SamplingParams(logit_bias=((5, -100.0), (9, 2.5)),
                                            structured=StructuredOutput("json_schema", '{"type": "object"}')))
P3 = m.WireSamplingParams.of(SamplingParams(allowed_token_ids=(3, 5, 8), include_stop_str_in_output=True,
                                            skip_special_tokens=False, bad_words=((4,), (6, 7, 9)), lora="sql",
                                            priority=-3, prediction=(11, 12, 13)))
P4 = m.WireSamplingParams.of(SamplingParams(max_tokens=1, pooling=Pooling("mean", False, 64), lora="sql"))
ROOT = Path(__file__).resolve().parents[1]
LP = TokenLogprobs(9, -0.5, ((9, -0.5), (4, -1.25)))

EXAMPLES = [
    m.GenerateRequest("a", (1, 2, 3), P),
    m.PrefillRequest("b", (4, 5), P, "10.0.0.1:1234"),
    m.PrefillRequest("b2", (4, 5), P2, "10.0.0.1:1234", resumed_token_ids=(6,), shown_chars=1),
    m.PrefillRequest("b3", tuple(range(40)), P, "10.0.0.1:1234", skip_blocks=2),
    m.PrefillResult("b", first_token=9, finish_reason=None, num_cached_tokens=16, prefill_seconds=0.5),
    m.PrefillResult("b", first_token=9, prefill_seconds=0.5, queue_seconds=0.25),
    m.PrefillResult("c", error="boom", error_code=503),
    m.PrefillResult("b", first_token=9, first_text="x", first_logprobs=LP,
                    prompt_logprobs=(TokenLogprobs(3, -2.0, rank=12), LP)),
    m.DecodeRequest("d", (1,), P),
    m.DecodeRequest("d3", (1,), P3),
    m.Reserved("d", "10.0.0.2:4321", 3),
    m.Reserved("d2", "10.0.0.2:4321", 1, cached_blocks=2),
    m.Landed("d"),
    m.KVHandoff(5, 2),
    m.HandoffDone("d", True),
    m.HandoffDone("d", False, "receiver: unknown or expired request 'd'"),
    m.TokenEvent("e", (1, 2), "hi", True, "stop", 3, 2, 0),
    m.TokenEvent("e", (9, 2), "hi", logprobs=(LP, TokenLogprobs(2, -3.0)), prompt_logprobs=(LP,)),
    m.ErrorEvent("f", "bad", 400, "invalid_request_error"),
    m.ReplicaStats("decode", "r1", 100, 90, 2, 0, 0, {"preemptions": 1}),
    m.ReplicaStats("prefill", "p1", 100, 90, 0, 1, 7, {}, {"kv_transfer_seconds": {
        "buckets": [0.1, 1.0], "counts": [1, 2], "sum": 0.6, "count": 2}}),
    m.StoredResponse("resp_1", '{"id": "resp_1", "output": []}', '[{"type": "message", "role": "user"}]'),
    m.StoredResponse("resp_2", '{"id": "resp_2", "status": "in_progress"}', "[]", owner="4f2a"),
    m.RuntimeLoraRegistry(("sql", "chat"), ("/a/sql", "/a/chat"), (7, 2**61)),
    m.EmbedRequest("g", ((1, 2, 3), (4,)), P4),
    m.Embedded("g", (b"\x00\x00\x80?" * 3, b"\x00" * 12), 4, 1),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg
    assert m.decode(m.encode(msg), expect=type(msg)) == msg


@pytest.mark.parametrize("params", [P, P2, P3, P4])
def test_params_round_trip_to_sampling_params(params):
    assert m.WireSamplingParams.of(params.to_params()) == params
    assert m.WireSamplingParams.of(m.decode(m.encode(m.DecodeRequest("d", (1,), params))).params.to_params()) == params


def test_structured_params_arrive_as_the_engines_types():
    params = m.decode(m.encode(m.DecodeRequest("d", (1,), P2))).params.to_params()
    assert params.structured == StructuredOutput("json_schema", '{"type": "object"}')
    assert params.logit_bias == ((5, -100.0), (9, 2.5)) and params.validate() is None
    embed = m.decode(m.encode(m.EmbedRequest("g", ((1,),), P4))).params.to_params()
    assert embed.pooling == Pooling("mean", False, 64) and embed.whole_prompt and embed.validate() is None


@pytest.mark.parametrize("data", [b"", b"\xc1garbage", msgpack.packb([99, "TokenEvent", {}]),
                                  msgpack.packb([1, "Nope", {}]), msgpack.packb([1, "TokenEvent", [1]]),
                                  msgpack.packb([1, "TokenEvent", {"request_id": "x", "bogus": 1}]),
                                  msgpack.packb([1, "TokenEvent", {"request_id": "x", "logprobs": [
                                      {"token_id": "a", "logprob": 0.0, "top": []}]}]),
                                  msgpack.packb([1, "DecodeRequest", {"request_id": "x", "prompt_token_ids": [1],
                                                                       "params": {**dataclasses.asdict(P),
                                                                                  "logit_bias": [["a", 1]]}}]),
                                  msgpack.packb([1, "PrefillResult", {"request_id": "x", "first_logprobs": {
                                      "token_id": 1, "logprob": 0.5, "top": [[1]]}}]),
                                  b"x" * (m.MAX_MESSAGE_BYTES + 1), "not bytes"])
def test_bad_bytes_are_rejected(data):
    with pytest.raises(m.MessageError):
        m.decode(data)


def test_wrong_type_is_rejected():
    with pytest.raises(m.MessageError):
        m.decode(m.encode(EXAMPLES[0]), expect=m.TokenEvent)


def test_fields_added_later_default_when_an_older_sender_omits_them():
    old = m.decode(msgpack.packb([1, "PrefillResult", {"request_id": "x", "first_token": 3, "prefill_seconds": 0.5}]))
    assert old.queue_seconds == 0.0 and old.prefill_seconds == 0.5 and old.first_logprobs is None
    params = {k: v for k, v in dataclasses.asdict(P).items() if k not in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs")}
    old = m.decode(msgpack.packb([1, "PrefillRequest", {"request_id": "x", "prompt_token_ids": [1],
                                                        "params": params, "kv_address": "a:1"}]))
    assert old.params.to_params().repetition_penalty == 1.0 and old.params.logprobs is None
    assert old.skip_blocks == 0       # a router before decode-side reuse: the whole K/V is pushed
    assert m.decode(msgpack.packb([1, "Reserved", {"request_id": "x", "kv_address": "a:1",
                                                   "num_blocks": 2}])).cached_blocks == 0
    stats = {"pool": "decode", "replica_id": "r", "kv_blocks_total": 1, "kv_blocks_free": 1, "running": 0,
             "waiting": 0, "waiting_prompt_tokens": 0, "extra": {}}
    assert m.decode(msgpack.packb([1, "ReplicaStats", stats])).histograms == {}


def test_the_stats_registry_and_response_store_load_neither_torch_nor_transformers():
    """They only read this module's messages; a replica's start is mostly its imports (transformers
    alone ~0.6 s of CPU, torch ~1.8), and a test session starts these two ~45 times."""
    code = ("import sys, serving.stats_registry, router.response_store; "
            "print(sorted(m for m in ('torch', 'transformers', 'llguidance.hf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
