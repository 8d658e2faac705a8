"""Timeouts and authentication end to end (tiny model, short timeouts): while the only decode
replica is frozen (SIGSTOP) no decode slot can be had on it, and the client gets a clean 504 at its
deadline instead of hanging; both pools end with every block free once the replica thaws, and
service resumes. (A KV push to a frozen receiver timing out is tested in test_kvt_faults.py.) A client
that leaves right after its first token, again and again while other streams run on the same
prefill->decode pair: the router tells both sides at once, nothing waits for the abandoned hand-off,
the other streams go on, and both pools free everything. The API key guards every endpoint but
/health, as a bearer token or (Anthropic's clients) an x-api-key header."""

import json
import os
import signal
import time

import psutil
import pytest
from service_util import http, leave_at_first_token, pools_all_free, stream_times, tiny_app

pytestmark = pytest.mark.slow
KEY = {"Authorization": "Bearer test-key"}
BODY = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "to", request_timeout_s=8, api_key="test-key",
                  transfer={"connect_timeout_s": 3, "transfer_timeout_s": 3, "lease_s": 5}) as base:
        yield base


def test_api_key_guards_everything_but_health(app):
    assert http(app, "/health")[0] == 200
    assert http(app, "/v1/models")[0] == 401
    assert http(app, "/v1/completions", BODY)[0] == 401
    assert http(app, "/v1/completions", BODY, headers={"Authorization": "Bearer nope"})[0] == 401
    assert http(app, "/v1/completions", BODY, headers=KEY)[0] == 200
    assert http(app, "/metrics", headers=KEY)[0] == 200
    assert http(app, "/v1/completions", BODY, headers={"x-api-key": "test-key"})[0] == 200
    message = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert http(app, "/v1/messages", message, headers={"x-api-key": "test-key"})[0] == 200
    status, text = http(app, "/v1/messages", message, headers={"x-api-key": "nope"})
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error", text   # Anthropic's


def test_frozen_decode_replica_times_out_cleanly_and_frees_everything(app):
    assert http(app, "/v1/completions", BODY, headers=KEY)[0] == 200   # the pair exists and works
    procs = [p for p in psutil.process_iter(["cmdline"])
             if "ServeReplica:to:DecodeServer" in " ".join(p.info.get("cmdline") or [])]
    assert len(procs) == 1
    os.kill(procs[0].pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        status, text = http(app, "/v1/completions", BODY, headers=KEY, timeout=60)
        elapsed = time.monotonic() - start
        assert status == 504 and "deadline" in text, (status, text)
        assert elapsed < 8 + 5
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
    # whatever the frozen replica had started (a reservation, a transfer) is freed once it thaws
    assert pools_all_free(app, {"prefill", "decode"}, timeout=45, headers=KEY)
    assert http(app, "/v1/completions", BODY, headers=KEY)[0] == 200


def test_clients_leaving_at_their_first_token_hold_up_no_other_stream(app):
    """Four times: a client streams a prompt and closes the connection at its first token, and
    right after it another client streams a request to the end on the same pair. The abandoned
    hand-off is dropped at once on both sides (no reservation waits out its lease, no push waits
    for a reservation), so every other stream completes with its text and its first-to-second
    token gap is nowhere near the lease (5 s here; before reserve-first the orphaned push held the
    pair for reservation_wait_s, 10 s by default); then both pools are all free."""
    gaps = []
    for i in range(4):
        leave_at_first_token(app, {**BODY, "prompt": list(range(100, 300)), "max_tokens": 50,
                                   "ignore_eos": True, "stream": True}, KEY)
        times, text = stream_times(app, {**BODY, "prompt": list(range(400 + i, 440 + i)), "max_tokens": 8,
                                         "ignore_eos": True, "stream": True}, KEY)
        assert len(times) >= 2, (times, text)
        gaps.append(times[1] - times[0])
    assert max(gaps) < 2.5, gaps      # a normal step is tens of ms; a wait-out is the lease
    assert pools_all_free(app, {"prefill", "decode"}, timeout=30, headers=KEY)
    assert http(app, "/v1/completions", BODY, headers=KEY)[0] == 200
