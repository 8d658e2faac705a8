"""The SLO policy on a local Ray cluster with a tiny model, deployed as Serve deploys a config (an
application-level policy lives in the application config; `pdserve serve` deploys the same way).

The per-replica model is pinned (hardware preset with efficiencies chosen so that, for this tiny
model, a prompt of ~300 tokens "takes" 0.8 s to prefill and a decode step 0.1 s; the correction is
off), so that any load of at least 0.5 req/s needs 2 prefill and 2 decode replicas and no load needs
1 of each: under load both pools grow to 2 (the predicted counts, capped by max_replicas), after it
they shrink back to 1 while a long stream runs; no request fails, the stream completes, no block leaks.
"""

import threading
import time

import pytest

from pdserve.serve_config import deploy, slo_policy
from pdserve.plan.model import resolve_spec
from service_util import (STATUS_POLL_S, TINY_ENGINE, closed_loop_load, delete_app, http, pools_all_free, reaches,
                          running_by_pool, wait_healthy, wait_until)
from serving.config import AppConfig
from serving.slo_model import StepModel, Workload, size_fleet

pytestmark = pytest.mark.slow
NAME = "slo"


def at_one_each() -> bool:
    running = running_by_pool(NAME)
    return running["PrefillServer"] == running["DecodeServer"] == 1


def config(model_dir) -> AppConfig:
    spec = resolve_spec(str(model_dir))
    prefill_eff = 2 * spec.params * 300 / (989e12 * 0.8)        # h100 preset: 300 prompt tokens in 0.8 s
    decode_eff = spec.weight_bytes / (3.35e12 * 0.1)             # a decode step of 0.1 s
    return AppConfig(
        mode="disaggregated", model=str(model_dir), served_model_name="tiny", route_prefix=f"/{NAME}",
        engine=TINY_ENGINE, transfer={"host": "127.0.0.1"}, decode={"engine": {"max_num_seqs": 2}},
        autoscaling={"ttft_slo": 1.0, "tpot_slo": 0.5, "hardware": "h100", "prefill_eff": prefill_eff,
                     "decode_eff": decode_eff, "correction_gain": 0.0, "warmup_s": 4, "window_s": 6,
                     "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2,
                     "metrics_interval_s": 0.5, "prefill": {"max_replicas": 2}, "decode": {"max_replicas": 2}})


def test_slo_policy_grows_both_pools_to_the_predicted_counts_and_back(ray_serve, tiny_llama_dir):
    cfg = config(tiny_llama_dir)
    model = StepModel(**slo_policy(cfg)["policy_kwargs"]["model"])
    for rate in (0.5, 2.0, 20.0):                                 # what the policy will predict under load
        size = size_fleet(model, Workload(rate, 300, 64), 1.0, 0.5)
        assert size.prefill >= 2 and size.decode >= 2, size
    idle = size_fleet(model, Workload(0.0, 300, 64), 1.0, 0.5)
    assert (idle.prefill, idle.decode) == (1, 1)
    deploy(cfg, NAME, f"/{NAME}")
    base = f"{ray_serve}/{NAME}"
    try:
        wait_healthy(base)
        assert at_one_each()
        peak = {"PrefillServer": 1, "DecodeServer": 1}
        with closed_loop_load(base, 4, 64) as statuses:
            up = reaches(peak, NAME, {"PrefillServer": 2, "DecodeServer": 2}, 90)
        assert up, f"peak replicas under load: {peak}"
        stream = []

        def long_stream():
            status, text = http(base, "/v1/completions", {"model": "tiny", "prompt": [7] * 20, "max_tokens": 800,
                                                          "ignore_eos": True, "temperature": 0, "stream": True},
                                timeout=300)
            stream.append((status, text.rstrip().endswith("data: [DONE]"), '"error"' in text, time.monotonic()))
        long = threading.Thread(target=long_stream)
        long.start()
        down = wait_until(at_one_each, 90, every=STATUS_POLL_S)
        long.join()
        assert down, "the pools did not scale back to 1:1"
        assert [s[:3] for s in stream] == [(200, True, False)]
        assert statuses and all(s == 200 for s in statuses), f"{statuses.count(200)}/{len(statuses)} ok"
        assert pools_all_free(base, {"prefill", "decode"})
    finally:
        delete_app(NAME)
