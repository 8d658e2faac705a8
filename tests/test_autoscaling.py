"""Autoscaling policies with synthetic contexts: up, hold, down, bounds, no flapping.

The policies run inside Serve's own wrapper (`_apply_autoscaling_config`), which adds the
pool's min/max bounds and delays, exactly as the Serve controller calls them.
"""

import logging

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pdserve.serve_config import autoscaling_config
from serving.autoscaling import KV_LOAD, QUEUED_LOAD, RUNNING_LOAD, DecodePolicy, PrefillPolicy, decide, load_metrics
from serving.scaling_config import AutoscalingOptions, ScalingTargets
from serving.serve_logging import SERVE_LOGGER


def ctx(metrics, replicas, state=None, now=100.0, min_r=1, max_r=4, target=None, requests=1.0, upscale_delay_s=0):
    """`requests`: Serve's total_num_requests (running on the replicas and waiting at handles)."""
    ids = [f"r{i}" for i in range(replicas)]
    per_replica = {name: dict(zip(ids, values)) for name, values in metrics.items()}
    return AutoscalingContext(
        deployment_id=DeploymentID(name="pool", app_name="app"), deployment_name="pool", app_name="app",
        current_num_replicas=replicas, target_num_replicas=replicas if target is None else target,
        running_replicas=ids, total_num_requests=requests, total_queued_requests=0.0, aggregated_metrics=per_replica,
        raw_metrics={}, capacity_adjusted_min_replicas=min_r, capacity_adjusted_max_replicas=max_r,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=AutoscalingConfig(min_replicas=min_r, max_replicas=max_r, upscale_delay_s=upscale_delay_s,
                                 downscale_delay_s=0))


def run(policy, c):
    return _apply_autoscaling_config(policy)(c)


OLD = {"first_seen": {"r0": 0.0, "r1": 0.0, "r2": 0.0, "r3": 0.0}}


def test_decide_rules():
    assert decide(2.3, 2, 0.2, False).replicas == 3
    assert decide(1.5, 2, 0.2, False).replicas == 2          # hold inside the band
    assert decide(0.7, 2, 0.2, False).replicas == 1          # one step down
    assert decide(0.1, 4, 0.2, False).replicas == 3          # never more than one step down
    assert decide(0.1, 2, 0.2, True).replicas == 2           # no scale-down while warming up


def loads(targets: ScalingTargets, queued=None, kv=None, running=None) -> dict[str, list[float]]:
    """What each replica reports (`load_metrics`, as EngineReplica.record_autoscaling_stats) for
    these raw signals, one value per replica, as `ctx` takes them."""
    n = len(queued or kv or running)
    per_replica = [load_metrics((queued or [0] * n)[i], (kv or [0] * n)[i], (running or [0] * n)[i], targets)
                   for i in range(n)]
    names = ([QUEUED_LOAD] if queued else []) + ([KV_LOAD, RUNNING_LOAD] if kv or running else [])
    return {name: [r[name] for r in per_replica] for name in names}


def test_prefill_scales_up_on_queued_tokens():
    t = ScalingTargets(target_queued_tokens=2048)
    n, _ = run(PrefillPolicy(), ctx(loads(t, queued=[3000, 2500]), 2, OLD))
    assert n == 3


def test_prefill_holds_then_scales_down_one_at_a_time():
    p, t = PrefillPolicy(hysteresis=0.2), ScalingTargets(target_queued_tokens=1000)
    assert run(p, ctx(loads(t, queued=[900, 700]), 2, OLD))[0] == 2      # 1.6 replicas: hold
    assert run(p, ctx(loads(t, queued=[100, 0, 0]), 3, OLD))[0] == 2     # 0.1: one down


def test_decode_scales_on_kv_and_running():
    p, t = DecodePolicy(), ScalingTargets(target_kv_utilization=0.5, target_running=10)
    assert run(p, ctx(loads(t, kv=[0.9], running=[2]), 1, OLD))[0] == 2      # KV-bound
    assert run(p, ctx(loads(t, kv=[0.1], running=[25]), 1, OLD))[0] == 3     # running-bound
    assert run(p, ctx(loads(t, kv=[0.1, 0.0], running=[1, 0]), 2, OLD))[0] == 1


def test_the_replicas_targets_decide_a_new_target_needs_no_new_policy():
    p = DecodePolicy()
    metrics = {"kv": [0.1, 0.1], "running": [12, 12]}
    assert run(p, ctx(loads(ScalingTargets(target_running=32), **metrics), 2, OLD))[0] == 1   # 0.75 replicas
    assert run(p, ctx(loads(ScalingTargets(target_running=8), **metrics), 2, OLD))[0] == 3    # 3 replicas


def test_bounds_are_applied():
    p, t = DecodePolicy(), ScalingTargets(target_kv_utilization=0.5, target_running=1)
    assert run(p, ctx(loads(t, kv=[1.0], running=[50]), 1, OLD, max_r=3))[0] == 3
    assert run(p, ctx(loads(t, kv=[0.0, 0.0], running=[0, 0]), 2, OLD, min_r=2))[0] == 2


@pytest.fixture
def controller_log():
    """The lines the policies write to Serve's logger (in Serve, the controller's log file)."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logger, handler = logging.getLogger(SERVE_LOGGER), Keep()
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(old)


def test_a_scaling_request_is_logged_once_with_its_reason_and_bound(controller_log):
    p, t = DecodePolicy(), ScalingTargets(target_kv_utilization=0.5, target_running=1)
    busy = loads(t, kv=[1.0], running=[50])
    n, state = run(p, ctx(busy, 1, OLD, max_r=3, upscale_delay_s=5))      # Serve waits out the delay
    assert n == 1 and controller_log == ["pdserve autoscaling pool: 1 -> 3 replicas (wants 50: max_replicas): "
                                         "load 50.00 replicas > 1"]
    for now in (101.0, 102.0):                                            # asking again: silent
        state = run(p, ctx(busy, 1, state, now=now, max_r=3, upscale_delay_s=5))[1]
    assert len(controller_log) == 1
    n, state = run(p, ctx(loads(t, kv=[0.5], running=[1]), 1, state, now=103.0, max_r=3))    # a tick of holding
    assert n == 1
    state = run(p, ctx(busy, 1, state, now=104.0, max_r=3, upscale_delay_s=5))[1]          # the same again: silent
    n, state = run(p, ctx(loads(t, kv=[0.5] * 3, running=[1] * 3), 3, state, max_r=3))   # there: nothing new
    assert n == 3 and len(controller_log) == 1
    n, state = run(p, ctx(loads(t, kv=[1.0] * 3, running=[9] * 3), 3, state, max_r=3))   # capped: said once
    n, state = run(p, ctx(loads(t, kv=[1.0] * 3, running=[10] * 3), 3, state, now=101.0, max_r=3))  # 30: the same
    assert n == 3 and controller_log[1:] == ["pdserve autoscaling pool: stays at 3 replicas (wants 27: "
                                             "max_replicas): load 27.00 replicas > 3"]
    del controller_log[1:]
    run(p, ctx({}, 0, {}, min_r=1, requests=0.0))               # Serve starting the pool at its min: not logged
    assert len(controller_log) == 1
    run(p, ctx(loads(t, kv=[0.0] * 3, running=[0] * 3), 3, state, now=200.0, max_r=3))   # past warm-up
    assert controller_log[-1] == "pdserve autoscaling pool: 3 -> 2 replicas: load 0.00 replicas fits in 2"


def test_no_flapping_on_a_fresh_replica():
    p, t = DecodePolicy(warmup_s=10), ScalingTargets(target_kv_utilization=0.5, target_running=4)
    n, state = run(p, ctx(loads(t, kv=[0.3], running=[6]), 1, {"first_seen": {"r0": 0.0}}, now=50))
    assert n == 2
    # the new replica reports zeros and the old one's load has not moved yet: summed load holds at 2
    n, state = run(p, ctx(loads(t, kv=[0.3, 0.0], running=[6, 0]), 2, state, now=51))
    assert n == 2
    # load falls while the new replica is still warming up: no scale-down yet
    n, state = run(p, ctx(loads(t, kv=[0.05, 0.0], running=[1, 0]), 2, state, now=55))
    assert n == 2 and "r1" in state["first_seen"]
    # after warm-up the low load may scale down
    n, _ = run(p, ctx(loads(t, kv=[0.05, 0.0], running=[1, 0]), 2, state, now=70))
    assert n == 1


def test_a_pool_that_may_scale_to_zero_goes_there_when_idle_and_comes_back_for_a_waiting_request():
    p, t = DecodePolicy(warmup_s=10), ScalingTargets(target_kv_utilization=0.5, target_running=4)
    idle = loads(t, kv=[0.2], running=[0])     # blocks still held in its prefix cache, nothing running
    # at zero: a request waiting at a handle starts a replica at once (Serve skips the upscale delay)
    assert run(p, ctx({}, 0, {}, min_r=0, requests=1.0, upscale_delay_s=30))[0] == 1
    assert run(PrefillPolicy(), ctx({}, 0, {}, min_r=0, requests=2.0, upscale_delay_s=30))[0] == 1
    assert run(p, ctx({}, 0, {}, min_r=0, requests=0.0))[0] == 0
    # one replica past its warm-up with no request running or waiting: to zero
    assert run(p, ctx(idle, 1, OLD, min_r=0, requests=0.0))[0] == 0
    # not while a request runs or waits, nor while it warms up, nor with min_replicas 1
    assert run(p, ctx(idle, 1, OLD, min_r=0, requests=1.0))[0] == 1
    assert run(p, ctx(idle, 1, {"first_seen": {"r0": 95.0}}, min_r=0, requests=0.0))[0] == 1
    assert run(p, ctx(idle, 1, OLD, min_r=1, requests=0.0))[0] == 1
    # from two replicas, one step at a time
    assert run(p, ctx(loads(t, kv=[0.0, 0.0], running=[0, 0]), 2, OLD, min_r=0, requests=0.0))[0] == 1


def test_missing_metrics_hold():
    assert run(PrefillPolicy(), ctx({}, 2, OLD))[0] == 2   # no signal yet: neither up nor down
    assert run(PrefillPolicy(), ctx({}, 1, OLD))[0] == 1
    # the raw signals alone (a replica without targets) are no load signal either
    assert run(DecodePolicy(), ctx({"kv_utilization": [1.0], "running": [99]}, 1, OLD))[0] == 1


def test_config_validation_and_serve_config():
    with pytest.raises(ValueError):
        AutoscalingOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        ScalingTargets(target_kv_utilization=0)
    with pytest.raises(ValueError):
        DecodePolicy(hysteresis=1)
    a = AutoscalingOptions(max_replicas=3, target_running=8, hysteresis=0.3)
    cfg = autoscaling_config("decode", a)
    assert cfg["max_replicas"] == 3 and cfg["policy"]["policy_function"] == "serving.autoscaling:DecodePolicy"
    assert cfg["policy"]["policy_kwargs"] == {"hysteresis": 0.3, "warmup_s": 10.0}     # no targets
    AutoscalingConfig(**cfg)   # Serve accepts it
    assert a.targets == ScalingTargets(target_running=8)
    assert "downscale_to_zero_delay_s" not in cfg
    cfg = autoscaling_config("prefill", AutoscalingOptions(min_replicas=0, initial_replicas=0,
                                                           downscale_to_zero_delay_s=120))
    assert (cfg["min_replicas"], cfg["initial_replicas"], cfg["downscale_to_zero_delay_s"]) == (0, 0, 120)
    assert AutoscalingConfig(**cfg).downscale_to_zero_delay_s == 120
    assert autoscaling_config("prefill", AutoscalingOptions(min_replicas=0))["initial_replicas"] == 0
