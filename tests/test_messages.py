"""Round trip of every wire message, and rejection of bad bytes."""

import msgpack
import pytest

from engine.sampling_params import SamplingParams
from pdserve import messages as m

P = m.WireSamplingParams.of(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=12, min_tokens=2,
                                           stop=("\n\n",), stop_token_ids=(7,), ignore_eos=True, seed=3))

EXAMPLES = [
    m.GenerateRequest("a", (1, 2, 3), P),
    m.PrefillRequest("b", (4, 5), P, "10.0.0.1:1234"),
    m.PrefillResult("b", first_token=9, finish_reason=None, num_cached_tokens=16, prefill_seconds=0.5),
    m.PrefillResult("c", error="boom", error_code=503),
    m.DecodeRequest("d", (1,), 5, P),
    m.TokenEvent("e", (1, 2), "hi", True, "stop", 3, 2, 0),
    m.ErrorEvent("f", "bad", 400, "invalid_request_error"),
    m.ReplicaStats("decode", "r1", 100, 90, 2, 0, 0, {"preemptions": 1}),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg
    assert m.decode(m.encode(msg), expect=type(msg)) == msg


def test_params_round_trip_to_sampling_params():
    assert m.WireSamplingParams.of(P.to_params()) == P


@pytest.mark.parametrize("data", [b"", b"\xc1garbage", msgpack.packb([99, "TokenEvent", {}]),
                                  msgpack.packb([1, "Nope", {}]), msgpack.packb([1, "TokenEvent", [1]]),
                                  msgpack.packb([1, "TokenEvent", {"request_id": "x", "bogus": 1}]),
                                  b"x" * (m.MAX_MESSAGE_BYTES + 1), "not bytes"])
def test_bad_bytes_are_rejected(data):
    with pytest.raises(m.MessageError):
        m.decode(data)


def test_wrong_type_is_rejected():
    with pytest.raises(m.MessageError):
        m.decode(m.encode(EXAMPLES[0]), expect=m.TokenEvent)
