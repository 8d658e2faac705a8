"""Pools that scale to zero (`min_replicas: 0` in a pool's autoscaling), deployed as `pdserve serve`
deploys (a Serve config whose pools' scaling is in the deployments' options, not in the router's
arguments): the app is healthy with no engine replica; a request waits while both pools start a
replica (together: router/wake.py) and is answered as by any app; once nothing runs or waits,
both pools go back to zero after their `downscale_to_zero_delay_s` (not the 30 s
`downscale_delay_s`), and the app is healthy again."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve

from pdserve.serve_config import deploy
from serving.config import AppConfig
from service_util import TINY_ENGINE, delete_app, http, running_replicas, wait_healthy, wait_until

pytestmark = pytest.mark.slow
ZERO = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "downscale_delay_s": 30,
        "downscale_to_zero_delay_s": 2, "look_back_period_s": 1, "metrics_interval_s": 0.5, "warmup_s": 2}
POOLS = ("PrefillServer", "DecodeServer")


def test_idle_pools_scale_to_zero_and_a_request_brings_both_back(ray_serve, tiny_llama_dir):
    cfg = AppConfig(model=str(tiny_llama_dir), served_model_name="tiny", engine=TINY_ENGINE,
                    transfer={"host": "127.0.0.1"}, prefill={"autoscaling": ZERO}, decode={"autoscaling": ZERO})
    wait_until(lambda: "zero" not in serve.status().applications, 60)
    deploy(cfg, "zero", "/zero")
    base = f"{ray_serve}/zero"
    try:
        wait_healthy(base)
        assert [running_replicas("zero", p) for p in POOLS] == [0, 0]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        started, healths = time.monotonic(), []
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(http, base, "/v1/completions", {**body, "stream": True}, 300)
            while not request.done():      # the pools are starting from zero: still healthy
                healths.append(http(base, "/health")[0])
                time.sleep(0.25)
            status, text = request.result()
        print(f"\na request to pools at zero took {time.monotonic() - started:.1f} s")
        assert status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text
        assert healths and set(healths) == {200}, healths
        assert [running_replicas("zero", p) for p in POOLS] == [1, 1]
        assert wait_until(lambda: [running_replicas("zero", p) for p in POOLS] == [0, 0], 25), \
            [running_replicas("zero", p) for p in POOLS]
        assert http(base, "/health")[0] == 200
    finally:
        delete_app("zero")
