"""Autoscaling policies with synthetic contexts: up, hold, down, bounds, no flapping.

The policies run inside Serve's own wrapper (`_apply_autoscaling_config`), which adds the
pool's min/max bounds and delays, exactly as the Serve controller calls them.
"""

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pdserve.app_builder import autoscaling_config
from serving.autoscaling import DecodePolicy, PrefillPolicy, decide
from serving.config import AutoscalingOptions


def ctx(metrics, replicas, state=None, now=100.0, min_r=1, max_r=4, target=None):
    ids = [f"r{i}" for i in range(replicas)]
    per_replica = {name: dict(zip(ids, values)) for name, values in metrics.items()}
    return AutoscalingContext(
        deployment_id=DeploymentID(name="pool", app_name="app"), deployment_name="pool", app_name="app",
        current_num_replicas=replicas, target_num_replicas=target or replicas, running_replicas=ids,
        total_num_requests=1.0, total_queued_requests=0.0, aggregated_metrics=per_replica, raw_metrics={},
        capacity_adjusted_min_replicas=min_r, capacity_adjusted_max_replicas=max_r,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=AutoscalingConfig(min_replicas=min_r, max_replicas=max_r, upscale_delay_s=0, downscale_delay_s=0))


def run(policy, c):
    return _apply_autoscaling_config(policy)(c)


OLD = {"first_seen": {"r0": 0.0, "r1": 0.0, "r2": 0.0, "r3": 0.0}}


def test_decide_rules():
    assert decide(2.3, 2, 0.2, False).replicas == 3
    assert decide(1.5, 2, 0.2, False).replicas == 2          # hold inside the band
    assert decide(0.7, 2, 0.2, False).replicas == 1          # one step down
    assert decide(0.1, 4, 0.2, False).replicas == 3          # never more than one step down
    assert decide(0.1, 2, 0.2, True).replicas == 2           # no scale-down while warming up


def test_prefill_scales_up_on_queued_tokens():
    n, _ = run(PrefillPolicy(target_queued_tokens=2048), ctx({"queued_prompt_tokens": [3000, 2500]}, 2, OLD))
    assert n == 3


def test_prefill_holds_then_scales_down_one_at_a_time():
    p = PrefillPolicy(target_queued_tokens=1000, hysteresis=0.2)
    assert run(p, ctx({"queued_prompt_tokens": [900, 700]}, 2, OLD))[0] == 2      # 1.6 replicas: hold
    assert run(p, ctx({"queued_prompt_tokens": [100, 0, 0]}, 3, OLD))[0] == 2     # 0.1: one down


def test_decode_scales_on_kv_and_running():
    p = DecodePolicy(target_kv_utilization=0.5, target_running=10)
    assert run(p, ctx({"kv_utilization": [0.9], "running": [2]}, 1, OLD))[0] == 2      # KV-bound
    assert run(p, ctx({"kv_utilization": [0.1], "running": [25]}, 1, OLD))[0] == 3     # running-bound
    assert run(p, ctx({"kv_utilization": [0.1, 0.0], "running": [1, 0]}, 2, OLD))[0] == 1


def test_bounds_are_applied():
    p = DecodePolicy(target_kv_utilization=0.5, target_running=1)
    assert run(p, ctx({"kv_utilization": [1.0], "running": [50]}, 1, OLD, max_r=3))[0] == 3
    assert run(p, ctx({"kv_utilization": [0.0, 0.0], "running": [0, 0]}, 2, OLD, min_r=2))[0] == 2


def test_no_flapping_on_a_fresh_replica():
    p = DecodePolicy(target_kv_utilization=0.5, target_running=4, warmup_s=10)
    n, state = run(p, ctx({"kv_utilization": [0.3], "running": [6]}, 1, {"first_seen": {"r0": 0.0}}, now=50))
    assert n == 2
    # the new replica reports zeros and the old one's load has not moved yet: summed load holds at 2
    n, state = run(p, ctx({"kv_utilization": [0.3, 0.0], "running": [6, 0]}, 2, state, now=51))
    assert n == 2
    # load falls while the new replica is still warming up: no scale-down yet
    n, state = run(p, ctx({"kv_utilization": [0.05, 0.0], "running": [1, 0]}, 2, state, now=55))
    assert n == 2 and "r1" in state["first_seen"]
    # after warm-up the low load may scale down
    n, _ = run(p, ctx({"kv_utilization": [0.05, 0.0], "running": [1, 0]}, 2, state, now=70))
    assert n == 1


def test_missing_metrics_hold():
    assert run(PrefillPolicy(), ctx({}, 2, OLD))[0] == 2   # no signal yet: neither up nor down
    assert run(PrefillPolicy(), ctx({}, 1, OLD))[0] == 1


def test_config_validation_and_serve_config():
    with pytest.raises(ValueError):
        AutoscalingOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        DecodePolicy(target_kv_utilization=0)
    cfg = autoscaling_config("decode", AutoscalingOptions(max_replicas=3, target_running=8))
    assert cfg["max_replicas"] == 3 and cfg["policy"]["policy_function"] == "serving.autoscaling:DecodePolicy"
    assert cfg["policy"]["policy_kwargs"]["target_running"] == 8
    AutoscalingConfig(**cfg)   # Serve accepts it
