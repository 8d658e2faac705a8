"""Pools that scale to zero (`min_replicas: 0` in a pool's autoscaling), deployed as `pdserve serve`
deploys (a Serve config whose pools' scaling is in the deployments' options, not in the router's
arguments), disaggregated and colocated side by side: each app is healthy with no engine replica;
a request waits while its pools start a replica (both together in the disaggregated app:
router/wake.py) and is answered as by any app; once nothing runs or waits, the pools go back to
zero after their `downscale_to_zero_delay_s` (not the 30 s `downscale_delay_s`), and the apps are
healthy again."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve

from pdserve.serve_config import deploy
from serving.config import AppConfig
from service_util import STATUS_POLL_S, TINY_ENGINE, delete_app, http, running_by_pool, wait_healthy, wait_until

pytestmark = pytest.mark.slow
ZERO = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "downscale_delay_s": 30,
        "downscale_to_zero_delay_s": 2, "look_back_period_s": 1, "metrics_interval_s": 0.5, "warmup_s": 2}
APPS = {"zero": ("PrefillServer", "DecodeServer"), "czero": ("ColocatedServer",)}   # app: its engine pools


def _running(app: str) -> list[int]:
    running = running_by_pool(app)
    return [running[pool] for pool in APPS[app]]


def _from_zero(app: str, base: str, body: dict) -> tuple[int, str, list[int], float, list[int]]:
    """A streamed request to `app`'s pools at zero: its status and text, the app's /health answers
    meanwhile, how long it took and the pools' replicas at its end (read at once: a pool at 1 goes
    back to zero `downscale_to_zero_delay_s` later, maybe before the other app's request ends)."""
    started, healths = time.monotonic(), []
    with ThreadPoolExecutor(1) as pool:
        request = pool.submit(http, base, "/v1/completions", {**body, "stream": True}, 300)
        while not request.done():      # the pools are starting from zero: still healthy
            healths.append(http(base, "/health")[0])
            time.sleep(0.25)
        status, text = request.result()
    return status, text, healths, time.monotonic() - started, _running(app)


def test_idle_pools_scale_to_zero_and_a_request_brings_them_back(ray_serve, tiny_llama_dir):
    common = dict(model=str(tiny_llama_dir), served_model_name="tiny", engine=TINY_ENGINE)
    configs = {"zero": AppConfig(**common, transfer={"host": "127.0.0.1"}, prefill={"autoscaling": ZERO},
                                 decode={"autoscaling": ZERO}),
               "czero": AppConfig(**common, mode="colocated", colocated={"autoscaling": ZERO})}
    wait_until(lambda: not set(APPS) & set(serve.status().applications), 60)
    bases = {app: f"{ray_serve}/{app}" for app in APPS}
    try:
        for app, cfg in configs.items():
            deploy(cfg, app, f"/{app}")
        for app, base in bases.items():
            wait_healthy(base)
            assert set(_running(app)) == {0}, (app, _running(app))
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(len(APPS)) as pool:
            results = dict(zip(APPS, pool.map(lambda app: _from_zero(app, bases[app], body), APPS)))
        for app, (status, text, healths, took, running) in results.items():
            print(f"\na request to {app}'s pools at zero took {took:.1f} s")
            assert status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text, (app, text)
            assert healths and set(healths) == {200}, (app, healths)
            assert set(running) == {1}, (app, running)
        for app, base in bases.items():
            assert wait_until(lambda: set(_running(app)) == {0}, 25, every=STATUS_POLL_S), (app, _running(app))
            assert http(base, "/health")[0] == 200
    finally:
        for app in APPS:
            delete_app(app)
