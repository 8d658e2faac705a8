"""Timeouts and authentication end to end (tiny model, short timeouts): while the only decode
replica is frozen (SIGSTOP) no decode slot can be had on it, and the client gets a clean 504 at its
deadline instead of hanging; both pools end with every block free once the replica thaws, and
service resumes. (A KV push to a frozen receiver timing out is tested in test_kvt_faults.py.) A client
that leaves between the first token and the decode dispatch leaves a KV push with no reservation: the
decode replica drains it after `reservation_wait_s` and both pools free everything. The API key guards
every endpoint but /health."""

import os
import signal
import time

import psutil
import pytest
from service_util import http, metrics, pools_all_free, tiny_app, wait_until

pytestmark = pytest.mark.slow
KEY = {"Authorization": "Bearer test-key"}
BODY = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "to", request_timeout_s=8, api_key="test-key",
                  transfer={"connect_timeout_s": 3, "transfer_timeout_s": 3, "lease_s": 3,
                            "reservation_wait_s": 1}) as base:
        yield base


def test_api_key_guards_everything_but_health(app):
    assert http(app, "/health")[0] == 200
    assert http(app, "/v1/models")[0] == 401
    assert http(app, "/v1/completions", BODY)[0] == 401
    assert http(app, "/v1/completions", BODY, headers={"Authorization": "Bearer nope"})[0] == 401
    assert http(app, "/v1/completions", BODY, headers=KEY)[0] == 200
    assert http(app, "/metrics", headers=KEY)[0] == 200


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


def test_client_gone_between_first_token_and_decode_dispatch_frees_both_sides(app):
    """The router's own orchestrator, driven from here: take the first token (it comes from the
    prefill replica, whose push to the chosen decode replica is then under way), then leave before
    the decode is dispatched. No reservation ever exists for the push: the decode replica drains and
    nacks it after reservation_wait_s (1 s), the prefill replica counts a failed transfer and frees
    its blocks."""
    import asyncio

    from ray import serve

    from engine.sampling_params import SamplingParams
    from router.orchestrator import Orchestrator

    def failed_pushes():
        return sum(v for (n, p, _), v in metrics(app, KEY).items()
                   if n == "pdserve_kv_transfers_failed" and p == "prefill")

    async def first_token_then_leave():
        orchestrator = Orchestrator("disaggregated", prefill=serve.get_deployment_handle("PrefillServer", "to"),
                                    decode=serve.get_deployment_handle("DecodeServer", "to"))
        events = orchestrator.run("gone-after-first", list(range(100, 140)),
                                  SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        first = await events.__anext__()
        await events.aclose()
        return first

    before = failed_pushes()
    first = asyncio.run(first_token_then_leave())
    assert len(first.token_ids) == 1 and not first.finished
    assert wait_until(lambda: failed_pushes() == before + 1, 30), "the orphaned push was never nacked"
    assert pools_all_free(app, {"prefill", "decode"}, timeout=30, headers=KEY)
    assert http(app, "/v1/completions", BODY, headers=KEY)[0] == 200
