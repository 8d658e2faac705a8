"""Per-pool autoscaling on a local Ray cluster with a tiny model.

Under load the decode pool goes from 1 to 2 replicas (running sequences above target) and the
prefill pool scales on queued prompt tokens; after the load the decode pool returns to 1
replica while two long streams are still running: no request fails and no stream is cut (a
replica being removed stops taking requests and finishes its streams), and no block leaks.
"""

import random
import threading
import time

import pytest
from ray import serve

from service_util import http, pools_all_free, tiny_app, wait_until

pytestmark = pytest.mark.slow
SCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3,
           "look_back_period_s": 2, "metrics_interval_s": 0.5, "warmup_s": 4}


def replicas(app: str, deployment: str) -> int:
    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def test_pools_scale_up_under_load_and_back_down(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "as",
                  prefill={"autoscaling": {**SCALING, "target_queued_tokens": 64},
                           "engine": {"max_num_batched_tokens": 16}},
                  decode={"autoscaling": {**SCALING, "target_running": 3, "target_kv_utilization": 0.9}}) as base:
        assert replicas("as", "DecodeServer") == 1 and replicas("as", "PrefillServer") == 1
        statuses, stop = [], threading.Event()
        peak = {"DecodeServer": 1, "PrefillServer": 1}

        def client(seed):
            rng = random.Random(seed)
            while not stop.is_set():
                prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(200, 400))]
                statuses.append(http(base, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 150,
                                                              "ignore_eos": True, "temperature": 0})[0])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()

        def scaled_up():
            for name in peak:
                peak[name] = max(peak[name], replicas("as", name))
            return peak["DecodeServer"] == 2 and peak["PrefillServer"] == 2

        up = wait_until(scaled_up, 120)
        stop.set()
        for t in threads:
            t.join()
        assert up, f"peak replicas under load: {peak}"
        # two long streams (2 running < 0.8 x 3 per replica on one replica fewer, so the pool shrinks while
        # they run, and the router spreads them over both replicas): none may be cut
        streams = []

        def long_stream(seed):
            status, text = http(base, "/v1/completions", {"model": "tiny", "prompt": [seed + 100] * 20,
                                                          "max_tokens": 1900, "ignore_eos": True,
                                                          "temperature": 0, "stream": True}, timeout=300)
            streams.append((status, text.rstrip().endswith("data: [DONE]"), '"error"' in text,
                            time.monotonic()))
        long_threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
        for t in long_threads:
            t.start()
        assert wait_until(lambda: replicas("as", "DecodeServer") == 1, 90), "decode pool did not scale back down"
        scaled_down_at = time.monotonic()
        for t in long_threads:
            t.join()
        assert [s[:3] for s in streams] == [(200, True, False)] * 2, streams
        assert max(s[3] for s in streams) > scaled_down_at, "the streams ended before the scale-down"
        assert statuses and all(s == 200 for s in statuses), f"{statuses.count(200)}/{len(statuses)} ok"
        assert pools_all_free(base, {"prefill", "decode"})
