"""Replica faults on a local Ray cluster (tiny model): a decode replica killed mid-stream and a
prefill replica killed (a completion and an embedding sent right after it died both answered), and
a colocated replica killed mid-stream; the service moves the stream on or retries, never hangs, and
Serve replaces the replica. The response store killed: answers
still go out (saying whether they were kept), and its replacement starts empty."""

import http.client as httpclient
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from service_util import (STATUS_POLL_S, http, kill_replica, metrics, pools_all_free, running_replicas, tiny_app,
                          wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "ft", decode={"num_replicas": 2}) as base:
        yield base


@pytest.fixture(scope="module")
def colocated_app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "ftc", mode="colocated", colocated={"num_replicas": 2}) as base:
        yield base


def migrations(base) -> float:
    """The router's pdserve_request_migrations_total (one router replica here)."""
    _, text = http(base, "/metrics")
    return float(re.search(r"^pdserve_request_migrations_total (\S+)$", text, re.M).group(1))


def ok(base, n=1):
    return http(base, "/v1/completions", {"model": "tiny", "prompt": list(range(100, 100 + 40)), "max_tokens": n,
                                          "ignore_eos": True, "temperature": 0})[0] == 200


def _kill_mid_stream_and_compare(app: str, app_name: str, deployment: str, pool: str, pools: set[str]) -> None:
    """Migration (router/orchestrator.py): with the replica of `deployment` (pool `pool`) that
    runs a stream killed mid-way, the stream goes on from the surviving replica after the tokens
    the client already has, and ends as the uninterrupted request does: the same greedy tokens and
    text, no error event, usage counting the whole output once."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
            "logprobs": 1}
    status, text = http(app, "/v1/completions", body)
    assert status == 200, text
    ref = json.loads(text)
    before = migrations(app)

    def running() -> dict:
        return {r: v for (n, p, r), v in metrics(app).items() if n == "pdserve_running_requests" and p == pool}
    # the reference's replica reports it running for up to a stats period after it ended
    assert wait_until(lambda: not any(running().values()), 15)
    host, port = app.split("//")[1].split("/")[0].split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", f"/{app_name}/v1/completions", json.dumps({**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines, done = [resp.readline().decode()], threading.Event()
    assert resp.status == 200 and lines[0].startswith("data: {")
    busy = {}

    def find_busy():
        busy.update({r: v for r, v in running().items() if v > 0})
        return bool(busy)
    assert wait_until(find_busy, 15)
    kill_replica(deployment, next(iter(busy)), app_name)

    def drain():
        for line in resp:              # chunked decoding; ends with the response
            lines.append(line.decode())
        done.set()
    threading.Thread(target=drain, daemon=True).start()
    assert done.wait(60), f"the stream hung after its replica died: {len(lines)} lines, last {lines[-2:]}"
    conn.close()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert [x.strip() for x in lines if x.strip()][-1] == "data: [DONE]"
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    choices = [c for e in events for c in e["choices"]]
    tokens = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    assert "".join(c["text"] for c in choices) == ref["choices"][0]["text"]
    assert len(tokens) == 2000 and tokens == ref["choices"][0]["logprobs"]["tokens"]
    assert choices[-1]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 2000
    assert migrations(app) >= before + 1
    # other and later requests are served (the surviving replica, then the replacement)
    assert all(ok(app, 8) for _ in range(4))
    assert wait_until(lambda: running_replicas(app_name, deployment) == 2, 90, every=STATUS_POLL_S)
    assert pools_all_free(app, pools, timeout=30)


def test_decode_replica_killed_mid_stream_moves_the_stream_to_another_replica(app):
    _kill_mid_stream_and_compare(app, "ft", "DecodeServer", "decode", {"prefill", "decode"})


def test_colocated_replica_killed_mid_stream_moves_the_stream_to_another_replica(colocated_app):
    _kill_mid_stream_and_compare(colocated_app, "ftc", "ColocatedServer", "colocated", {"colocated"})


def embedding(base) -> list[float]:
    status, text = http(base, "/v1/embeddings", {"model": "tiny", "input": list(range(100, 140)),
                                                 "encoding_format": "float"})
    assert status == 200, text
    return json.loads(text)["data"][0]["embedding"]


def test_prefill_replica_killed_requests_still_succeed(app):
    assert ok(app)
    vector = embedding(app)
    kill_replica("PrefillServer")
    with ThreadPoolExecutor(1) as pool:          # an embedding sent right after it died too (router/orchestrator.py)
        again = pool.submit(embedding, app)
        assert ok(app, 4), "a request right after the prefill replica died failed"
        assert again.result() == pytest.approx(vector, abs=1e-6)
    assert wait_until(lambda: running_replicas("ft", "PrefillServer") == 1, 90, every=STATUS_POLL_S)
    assert all(ok(app, 4) for _ in range(3))
    assert pools_all_free(app, {"prefill", "decode"}, timeout=30)


def _saves(base) -> dict[str, float]:
    _, text = http(base, "/metrics")
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^pdserve_responses_saved_total\{result="(\w+)"\} (\S+)$', text, re.M)}


def test_response_store_killed_answers_still_go_out_and_its_replacement_starts_empty(app):
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2}
    status, text = http(app, "/v1/responses", body)
    assert status == 200 and json.loads(text)["store"] is True
    kept = json.loads(text)["id"]
    saved = _saves(app)
    kill_replica("ResponseStore")
    status, text = http(app, "/v1/responses", body, timeout=60)      # the store's calls give up after 5 s
    assert status == 200, text
    after = json.loads(text)
    result = "stored" if after["store"] else "not_stored"            # and /metrics counts which
    assert _saves(app) == {**saved, result: saved[result] + 1}
    assert wait_until(lambda: running_replicas("ft", "ResponseStore") == 1, 90, every=STATUS_POLL_S)
    # a GET is a 503 (the store unavailable) until the replacement answers: then 200 or 404, as it was kept or not
    codes = []
    assert wait_until(lambda: codes.append(http(app, f"/v1/responses/{after['id']}")[0]) or codes[-1] != 503, 90)
    assert codes[-1] == (200 if after["store"] else 404), codes
    status, text = http(app, "/v1/responses", {**body, "previous_response_id": kept})
    assert status == 404 and json.loads(text)["error"]["code"] == "previous_response_not_found"   # kept in memory only
    status, text = http(app, "/v1/responses", body)
    assert status == 200 and json.loads(text)["store"] is True
    assert http(app, f"/v1/responses/{json.loads(text)['id']}")[0] == 200
    assert pools_all_free(app, {"prefill", "decode"}, timeout=30)
