"""The SLO policy as Serve runs it: inside Serve's application-level wrapper
(`_apply_app_level_autoscaling_config`, which adds each pool's bounds and delays), with synthetic
contexts for the prefill pool, the decode pool and the router. Plus the router's window and the
config wiring (torch-free, fast)."""

import dataclasses
import logging
import math

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import ServeApplicationSchema

from pdserve.app_builder import _pool_options
from pdserve.serve_config import application_config
from router.slo_window import SloWindow
from serving.config import AppConfig
from serving.slo_autoscaling import (CACHED, INPUT, LOCAL_RATE, LOCAL_TOKENS, OUTPUT, RATE, REFUSED, SAMPLES,
                                     TPOT_P90, TTFT_P90, SloPolicy, observation)
from serving.slo_model import StepModel, Workload, local_ttft, mixed_ttft_p90, size_fleet, ttft_p90
from serving.serve_logging import SERVE_LOGGER
from serving.slo_policy import predicted_tpot

MODEL = StepModel(params=5e8, weight_bytes=1e9, kv_bytes_per_token=1e5, peak_flops=1e13, mem_bw=1e12,
                  link_bw=1e9, kv_tokens=100_000, max_num_seqs=4, max_batched_tokens=2048)
IDS = {name: DeploymentID(name=name, app_name="app") for name in ("PrefillServer", "DecodeServer", "Router")}
OLD = {"first_seen": {f"{p}/{k}r{i}": 0.0 for p in "pd" for k in ("PrefillServer", "DecodeServer")
                      for i in range(8)}}


def ctx(name, replicas, metrics=None, state=None, now=100.0, min_r=1, max_r=8, up=0.0, down=0.0):
    ids = [f"{name}r{i}" for i in range(replicas)]
    per_replica = {k: dict(zip(ids, v if isinstance(v, list) else [v] * replicas)) for k, v in (metrics or {}).items()}
    return AutoscalingContext(
        deployment_id=IDS[name], deployment_name=name, app_name="app", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=per_replica, raw_metrics={}, capacity_adjusted_min_replicas=min_r,
        capacity_adjusted_max_replicas=max_r, policy_state=dict(state or {}), last_scale_up_time=None,
        last_scale_down_time=None, current_time=now,
        config=AutoscalingConfig(min_replicas=min_r, max_replicas=max_r, upscale_delay_s=up, downscale_delay_s=down))


def router(rate, n_in=512.0, n_out=256.0, ttft=0.0, tpot=0.0, samples=0.0):
    return {RATE: rate, INPUT: n_in, OUTPUT: n_out, TTFT_P90: ttft, TPOT_P90: tpot, SAMPLES: samples}


def run(policy, p, d, r, **kw):
    contexts = {c.deployment_id: c for c in (p, d, r) if c is not None}
    decisions, states = _apply_app_level_autoscaling_config(policy)(contexts)
    return decisions.get(IDS["PrefillServer"]), decisions.get(IDS["DecodeServer"]), states


def policy(**kw):
    return SloPolicy(model=dataclasses.asdict(MODEL), ttft_slo=0.5, tpot_slo=0.02, **kw)


def test_a_load_step_sets_both_pools_to_the_planned_counts():
    expected = size_fleet(MODEL, Workload(40.0, 512, 256), 0.5, 0.02)
    assert expected.prefill >= 2 and expected.decode >= 2            # the step needs both pools to grow
    p, d, states = run(policy(), ctx("PrefillServer", 1, {"queued_prompt_tokens": 0}, OLD),
                       ctx("DecodeServer", 1, {}, OLD), ctx("Router", 1, router(40.0), max_r=1))
    assert (p, d) == (expected.prefill, expected.decode)
    assert "needs" in states[IDS["PrefillServer"]]["last_reason"]
    # light load before the step: one replica each
    p, d, _ = run(policy(), ctx("PrefillServer", 1, {}, OLD), ctx("DecodeServer", 1, {}, OLD),
                  ctx("Router", 1, router(1.0), max_r=1))
    assert (p, d) == (1, 1)


def test_the_policy_logs_what_it_asks_for_and_an_slo_it_cannot_meet_once(caplog):
    caplog.set_level(logging.INFO, logger=SERVE_LOGGER)
    expected = size_fleet(MODEL, Workload(40.0, 512, 256), 0.5, 0.02)
    state, dstate = dict(OLD), dict(OLD)
    for now in (100.0, 101.0):                                   # Serve hands each pool's state back
        p, d, states = run(policy(), ctx("PrefillServer", 1, {"queued_prompt_tokens": 0}, state, now=now),
                           ctx("DecodeServer", 1, {}, dstate, now=now),
                           ctx("Router", 1, router(40.0), max_r=1, now=now))
        state, dstate = states[IDS["PrefillServer"]], states[IDS["DecodeServer"]]
    lines = [r.getMessage() for r in caplog.records if "pdserve autoscaling" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith(f"pdserve autoscaling PrefillServer (SLO policy): 1 -> {p} "), lines
    assert lines[1].startswith(f"pdserve autoscaling DecodeServer (SLO policy): 1 -> {d} ") and "needs" in lines[1]
    assert (p, d) == (expected.prefill, expected.decode)
    caplog.clear()
    slow = {**router(1.0, n_in=100_000), RATE: 1.0}              # a prompt no replica prefills within the SLO
    for _ in range(3):
        state = run(policy(), ctx("PrefillServer", 1, {}, state), ctx("DecodeServer", 1, {}, OLD),
                    ctx("Router", 1, slow, max_r=1))[2][IDS["PrefillServer"]]
    held = [r for r in caplog.records if "SLO unreachable" in r.getMessage()]
    assert len(held) == 1 and held[0].levelno == logging.WARNING


def test_holds_without_router_metrics():
    for r in (None, ctx("Router", 1, {}, max_r=1)):
        p, d, states = run(policy(), ctx("PrefillServer", 3, {}, OLD), ctx("DecodeServer", 2, {}, OLD), r)
        assert (p, d) == (3, 2)
        assert states[IDS["PrefillServer"]]["last_reason"] == "no router metrics yet"


def test_scales_down_one_step_at_a_time_and_not_while_warming():
    pol, state = policy(), dict(OLD)
    counts = (6, 5)
    for expected in ((5, 4), (4, 3), (3, 2), (2, 1), (1, 1)):
        p, d, states = run(pol, ctx("PrefillServer", counts[0], {}, state), ctx("DecodeServer", counts[1], {}, OLD),
                           ctx("Router", 1, router(0.1), max_r=1))
        assert (p, d) == expected
        counts, state = (p, d), states[IDS["PrefillServer"]]
    fresh = {"first_seen": {}}                       # replicas first seen now: warming up, no scale-down
    assert run(pol, ctx("PrefillServer", 4, {}, fresh), ctx("DecodeServer", 4, {}, fresh),
               ctx("Router", 1, router(0.1), max_r=1))[:2] == (4, 4)


def test_bounds_and_serve_delays_apply_per_pool():
    p, d, _ = run(policy(), ctx("PrefillServer", 1, {}, OLD, max_r=2), ctx("DecodeServer", 1, {}, OLD, min_r=1, max_r=3),
                  ctx("Router", 1, router(400.0), max_r=1))
    assert (p, d) == (2, 3)
    # an upscale delay: Serve's wrapper holds the first tick's scale-up
    p, d, _ = run(policy(), ctx("PrefillServer", 1, {}, OLD, up=30), ctx("DecodeServer", 1, {}, OLD, up=30),
                  ctx("Router", 1, router(40.0), max_r=1))
    assert (p, d) == (1, 1)


def test_measured_percentiles_correct_the_model():
    pol = policy()
    w = Workload(15.0, 512, 256)
    plain = size_fleet(MODEL, w, 0.5, 0.02)
    tpot_pred = predicted_tpot(MODEL, w, plain.decode, 1.0)
    ttft_pred = ttft_p90(MODEL.prefill_time(512), 15.0, plain.prefill)
    state = dict(OLD)
    for _ in range(6):                    # measured TPOT twice the prediction, TTFT as predicted
        p, d, states = run(pol, ctx("PrefillServer", plain.prefill, {}, state),
                           ctx("DecodeServer", plain.decode, {}, OLD),
                           ctx("Router", 1, router(15.0, ttft=ttft_pred, tpot=2 * tpot_pred, samples=100), max_r=1))
        state = states[IDS["PrefillServer"]]
    cp, cd = state["correction"]
    assert cd == pytest.approx(2.0, rel=0.2) and cp == pytest.approx(1.0)
    assert d > plain.decode                # the slower decode than modelled needs more replicas


def test_a_backlog_grows_prefill_beyond_the_arrival_rate():
    base = run(policy(), ctx("PrefillServer", 1, {"queued_prompt_tokens": 0}, OLD), ctx("DecodeServer", 1, {}, OLD),
               ctx("Router", 1, router(10.0), max_r=1))
    more = run(policy(), ctx("PrefillServer", 1, {"queued_prompt_tokens": 200_000}, OLD),
               ctx("DecodeServer", 1, {}, OLD), ctx("Router", 1, router(10.0), max_r=1))
    assert more[0] > base[0]


def test_decode_backlog_grows_decode_beyond_the_arrival_rate():
    """Decode replicas' waiting sequences (one or more on average) and requests refused for want of
    decode KV are a backlog: decode grows beyond what the arrival rate alone needs, and the model's
    correction holds while they last."""
    def decode_count(waiting=0.0, refused=0.0):
        d, state = run(policy(), ctx("PrefillServer", 1, {"queued_prompt_tokens": 0}, OLD),
                       ctx("DecodeServer", 1, {"waiting": waiting}, OLD),
                       ctx("Router", 1, {**router(10.0), REFUSED: refused}, max_r=1))[1:]
        return d, state[IDS["PrefillServer"]].get("backlog_at")
    base, at = decode_count()
    assert at is None
    assert decode_count(waiting=0.5)[0] == base                  # a request landing between steps
    more, at = decode_count(waiting=400.0)
    assert more > base and at is not None
    refused, at = decode_count(refused=20.0)
    assert refused > base and at is not None


def test_prompts_found_in_prefix_caches_need_fewer_prefill_replicas():
    """A shared system prompt: of 4096-token prompts, 3584 come from the prefill replicas' prefix
    caches (the router's window reports them, `slo_cached_tokens`): the prefill pool is sized for
    the 512 computed, the decode pool as before (each sequence still holds and reads the whole context)."""
    whole = size_fleet(MODEL, Workload(100.0, 4096, 64), 0.5, 0.02)
    cached = size_fleet(MODEL, Workload(100.0, 4096, 64, cached_len=3584), 0.5, 0.02)
    assert cached.prefill < whole.prefill / 4 and cached.decode == whole.decode
    assert cached.prefill == size_fleet(MODEL, Workload(100.0, 512, 64), 0.5, 0.02).prefill
    p, d, _ = run(policy(), ctx("PrefillServer", 1, {}, OLD, max_r=64),
                  ctx("DecodeServer", 1, {}, OLD, max_r=64),
                  ctx("Router", 1, {**router(100.0, 4096, 64), CACHED: 3584.0}, max_r=1))
    assert (p, d) == (cached.prefill, cached.decode)


def test_local_prefills_load_the_decode_steps_not_the_prefill_pool():
    """A conversation's next turn prefilled in its decode replica (routing.local_prefill_tokens):
    the router's window reports those prompts' rate and size; the prefill pool is sized for the
    rest, the decode steps carry their tokens, and TTFT p90 is over every request."""
    # half local (48 computed of 4096), half handed off (1024 computed): the mean cached over all is
    # 3560, and the handed-off ones' computed tokens come out of the means
    half = Workload(100.0, 4096, 64, cached_len=3560, local_share=0.5, local_len=48)
    assert half.computed_len == pytest.approx(1024) and half.prefill_rate == 50.0
    assert half.local_rows == pytest.approx(0.5 * 48 / 64)
    with pytest.raises(ValueError):
        Workload(1.0, 10, 10, local_share=1.5)
    rate = 500.0
    handed = size_fleet(MODEL, Workload(rate, 4096, 64, cached_len=4048), 0.5, 0.02)
    every = Workload(rate, 4096, 64, cached_len=4048, local_share=1.0, local_len=48)
    local = size_fleet(MODEL, every, 0.5, 0.02)
    assert handed.prefill >= 3 and local.prefill == 1                  # one kept for the prompts caches miss
    assert local.tpot > handed.tpot and local.decode >= handed.decode  # the prompt rows ride in the steps
    assert local.ttft_p90 == pytest.approx(local_ttft(MODEL, every, local.decode_batch))
    assert local.ttft_p90 < MODEL.step_time(48, local.decode_batch, local.decode_batch * 4200) * 2.5
    # the p90 over every request: the pool's alone without local prefills, the local steps' at 90 %
    service = MODEL.prefill_time(1024)
    none, most = Workload(8.0, 4096, 64, 3072), Workload(8.0, 4096, 64, 3072, local_share=0.95, local_len=48)
    assert mixed_ttft_p90(service, none, 1, 0.0) == pytest.approx(ttft_p90(service, 8.0, 1))
    assert mixed_ttft_p90(service, most, 1, 0.004) == 0.004
    some = Workload(8.0, 4096, 64, 3072, local_share=0.5, local_len=48)
    assert 0.004 < mixed_ttft_p90(service, some, 1, 0.004) < ttft_p90(service, 8.0, 1)
    assert mixed_ttft_p90(service, some, 1, 10.0) == 10.0           # half the requests take 10 s
    few = Workload(8.0, 4096, 64, 3072, local_share=0.05, local_len=48)
    assert mixed_ttft_p90(service, few, 1, 10.0) == pytest.approx(ttft_p90(service, 8.0 * 0.95, 1, 0.05 / 0.95))
    # local prefills too few to be the p90 do not make the SLO unreachable however slow they are
    slow_steps = dataclasses.replace(MODEL, mem_bw=2e10)             # decode steps of ~130 ms at batch 4
    fleet = size_fleet(slow_steps, few, 0.2, 0.5)
    assert local_ttft(slow_steps, few, fleet.decode_batch) > 0.2 and fleet.prefill > 0 and fleet.ttft_p90 <= 0.2
    assert size_fleet(slow_steps, dataclasses.replace(few, local_share=0.2), 0.2, 0.5).prefill == 0   # unreachable
    assert mixed_ttft_p90(service, Workload(400.0, 4096, 64, 3072, 0.95, 48), 2, 0.004) == math.inf  # saturated
    # the live policy reads the window's local prefills
    p, d, _ = run(policy(), ctx("PrefillServer", 1, {}, OLD, max_r=64), ctx("DecodeServer", 1, {}, OLD, max_r=64),
                  ctx("Router", 1, {**router(rate, 4096, 64), CACHED: 4048.0, LOCAL_RATE: rate, LOCAL_TOKENS: 48.0},
                      max_r=1))
    assert (p, d) == (local.prefill, local.decode)
    # a measured TTFT p90 twice the prediction does not correct the prefill pool's model when local
    # prefills are the p90 (without the guard: x3.7 after four ticks)
    state = {"first_seen": {f"{x}/{k}r{i}": 0.0 for x in "pd" for k in IDS for i in range(64)}}   # none warming
    for _ in range(4):
        states = run(policy(), ctx("PrefillServer", p, {}, state, max_r=64), ctx("DecodeServer", d, {}, OLD, max_r=64),
                     ctx("Router", 1, {**router(rate, 4096, 64, ttft=2 * local.ttft_p90, tpot=local.tpot,
                                                samples=100), CACHED: 4048.0, LOCAL_RATE: rate, LOCAL_TOKENS: 48.0},
                         max_r=1))[2]
        state = states[IDS["PrefillServer"]]
    assert state["correction"][0] == 1.0
    p, _, _ = run(policy(), ctx("PrefillServer", 1, {}, OLD, max_r=64), ctx("DecodeServer", 1, {}, OLD, max_r=64),
                  ctx("Router", 1, {**router(rate, 4096, 64), CACHED: 4048.0}, max_r=1))
    assert p == handed.prefill
    # a prefill backlog is the handed-off prompts' (1028 tokens computed each here, 10 % of 100/s
    # besides 90 % local ones of 48): 10 + 100 of them a second at 0.1 s each need 12 replicas
    backlog = {"queued_prompt_tokens": 100 * 4096 * 20.0}        # 100 prompts/s more, over drain_s
    p, _, _ = run(policy(), ctx("PrefillServer", 1, backlog, OLD, max_r=64), ctx("DecodeServer", 1, {}, OLD, max_r=64),
                  ctx("Router", 1, {**router(100.0, 4096, 64), CACHED: 3950.0, LOCAL_RATE: 90.0, LOCAL_TOKENS: 48.0},
                      max_r=1))
    assert MODEL.prefill_time(1028) == pytest.approx(0.1028) and p >= 12
    # two router replicas: rates summed, the local prompts' size weighted by their rates
    obs = observation({RATE: {"a": 4.0, "b": 6.0}, LOCAL_RATE: {"a": 2.0, "b": 0.0},
                       LOCAL_TOKENS: {"a": 40.0, "b": 0.0}}, None)
    assert (obs.local_rate, obs.local_len) == (2.0, 40.0) and obs.workload().local_share == pytest.approx(0.2)


def test_router_window():
    w = SloWindow(window_s=10)
    for t in range(20):
        w.arrived(float(t), 100 + t)
    for t in range(10, 20):
        w.finished(float(t), ttft=0.1 * (t - 9), tpot=0.01, output_tokens=32)
    s = w.snapshot(19.5)
    assert s[RATE] == pytest.approx(10 / 10) and s[INPUT] == pytest.approx(sum(100 + t for t in range(10, 20)) / 10)
    assert s[OUTPUT] == 32 and s[SAMPLES] == 10 and s[TTFT_P90] == pytest.approx(0.9) and s[TPOT_P90] == 0.01
    assert SloWindow().snapshot(5.0)[RATE] == 0.0
    for t in (12.0, 19.0):
        w.refused(t)
    assert w.snapshot(19.5)[REFUSED] == pytest.approx(2 / 10) and w.snapshot(25.0)[REFUSED] == pytest.approx(1 / 10)
    assert w.snapshot(25.0)[CACHED] == 0.0
    w.finished(25.0, ttft=0.1, tpot=0.01, output_tokens=32, cached_tokens=64)
    assert w.snapshot(25.0)[CACHED] == pytest.approx(64 / 6)     # over the finished: t = 15..19, and this one
    assert w.snapshot(25.0)[LOCAL_RATE] == 0.0 and w.snapshot(25.0)[LOCAL_TOKENS] == 0.0
    w.local(24.0, 30)
    w.local(25.0, 50)
    assert w.snapshot(25.0)[LOCAL_RATE] == pytest.approx(2 / 10) and w.snapshot(25.0)[LOCAL_TOKENS] == 40.0
    assert w.snapshot(34.5)[LOCAL_RATE] == pytest.approx(1 / 10) and w.snapshot(34.5)[LOCAL_TOKENS] == 50.0


def test_config_wiring(monkeypatch):
    with pytest.raises(ValueError):
        AppConfig.model_validate({"mode": "colocated", "autoscaling": {"ttft_slo": 1, "tpot_slo": 0.1}})
    with pytest.raises(ValueError):
        AppConfig.model_validate({"autoscaling": {"ttft_slo": 1, "tpot_slo": 0.1},
                                  "decode": {"autoscaling": {"max_replicas": 2}}})
    cfg = AppConfig.model_validate({"autoscaling": {"ttft_slo": 1, "tpot_slo": 0.1, "hardware": "h100",
                                                    "prefill_eff": 0.5, "decode_eff": 0.5,
                                                    "decode": {"max_replicas": 6}}})
    opts = _pool_options("decode", cfg.decode, None, slo=cfg.autoscaling)
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 6
    assert "policy" not in opts["autoscaling_config"]                  # the app's policy decides
    AutoscalingConfig(**opts["autoscaling_config"])
    monkeypatch.setattr("pdserve.serve_config.resolve_model", lambda *a, **k: "qwen2.5-7b")
    app = application_config(cfg, "x", "/")
    assert app["autoscaling_policy"]["policy_function"] == "serving.slo_autoscaling:SloPolicy"
    ServeApplicationSchema(**app)                                       # Serve accepts it
    kwargs = app["autoscaling_policy"]["policy_kwargs"]
    assert SloPolicy(**kwargs).m.prefill_eff == 0.5 and kwargs["ttft_slo"] == 1
    assert "autoscaling_policy" not in application_config(AppConfig(), "x")


def test_a_sliding_window_sizes_the_decode_batch_by_what_a_sequence_reads_and_holds():
    """Long outputs under a KV budget: with a window on every layer each sequence holds about its
    window (its prompt while it lands), so the decode batch the policy plans with is larger, and
    each step reads only the window: fewer decode replicas for the same load. A window on some of
    the layers keeps every block: the batch stays bound by memory, only the reads shrink."""
    m = dataclasses.replace(MODEL, kv_tokens=40_000, max_num_seqs=256)
    load = Workload(rate=2.0, input_len=1000, output_len=9000)
    every = dataclasses.replace(m, window=2000, window_share=1.0)
    some = dataclasses.replace(m, window=2000, window_share=0.5)
    sizes = {name: size_fleet(model, load, 10.0, 1.0) for name, model in (("full", m), ("every", every),
                                                                             ("some", some))}
    assert (sizes["full"].decode_batch, sizes["some"].decode_batch, sizes["every"].decode_batch) == (4, 4, 20)
    assert sizes["every"].decode < sizes["full"].decode
    assert sizes["some"].tpot < sizes["full"].tpot and sizes["some"].decode <= sizes["full"].decode
    assert every.tpot(8, 5500) == pytest.approx(m.tpot(8, 2000))
    with pytest.raises(ValueError, match="window_share"):
        dataclasses.replace(m, window_share=0.5)
