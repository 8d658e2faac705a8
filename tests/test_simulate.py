"""`pdserve simulate`: the discrete-event simulator against hand-computed timings, KV budgets,
routing, autoscaling and the CLI (pure Python, fast)."""

import dataclasses
import itertools
import math
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.plan.sim_load import Request, parse_schedule, poisson, read_trace
from pdserve.plan.sim_report import summarize
from pdserve.plan.sim_scaling import Bounds, PerPoolScaler, SloScaler
from pdserve.plan.sim_replicas import DecodeReplica
from pdserve.plan.simulator import Fleet, Simulator, replica_seconds
from serving.slo_model import StepModel
from serving.slo_policy import SloTargets

# 1 GFLOP per token-pass, 1 GB of weights: a step of T prompt tokens + B sequences costs
# max((T + B) / 1000, (1 + ctx * 1e-6)) ms-ish; numbers below chosen so each term is easy to follow
M = StepModel(params=5e8, weight_bytes=1e9, kv_bytes_per_token=1e5, peak_flops=1e12, mem_bw=1e12, link_bw=1e9,
              kv_tokens=10_000, max_num_seqs=8, max_batched_tokens=512)


def req(i, t, n_in, n_out):
    return Request(i, t, n_in, n_out)


def test_step_model_prices_compute_and_memory():
    assert M.step_time(512) == pytest.approx(max(2 * 5e8 * 512 / 1e12, (1e9 + 1e5 * 512) / 1e12))   # 0.512 s compute
    assert M.step_time(0, 2, 20000) == pytest.approx((1e9 + 1e5 * 20000) / 1e12)                      # memory-bound
    assert M.prefill_time(1024) == pytest.approx(2 * M.step_time(512))                              # two chunks
    with pytest.raises(ValueError):
        StepModel(0, 1, 1, 1, 1, 1)


def test_one_request_disaggregated_matches_hand_timing():
    r = req(0, 0.0, 1024, 5)
    res = Simulator(M, Fleet("disaggregated", 1, 1)).run([r], 10.0)
    assert r.ttft == pytest.approx(2 * M.step_time(512))                 # chunked: two prefill steps
    transfer = 1e5 * 1024 / 1e9
    steps = sum(M.step_time(0, 1, 1025 + k) for k in range(4))           # context grows one token a step
    assert r.end - r.first == pytest.approx(transfer + steps)
    assert res.timeline == [] and replica_seconds(res) == pytest.approx(20.0)


def test_short_prompts_share_a_prefill_step():
    # a starts a step at once; b and c arrive during it and share the next one (chunked prefill)
    a, b, c = req(0, 0.0, 100, 2), req(1, 0.01, 200, 2), req(2, 0.02, 200, 2)
    Simulator(M, Fleet("disaggregated", 1, 1)).run([a, b, c], 10.0)
    assert a.first == pytest.approx(M.step_time(100))
    assert b.first == c.first == pytest.approx(a.first + M.step_time(400))


def test_colocated_one_request():
    r = req(0, 0.0, 100, 3)
    Simulator(M, Fleet("colocated", 1)).run([r], 10.0)
    assert r.ttft == pytest.approx(M.step_time(100))
    assert r.end - r.first == pytest.approx(M.step_time(0, 1, 101) + M.step_time(0, 1, 102))


def test_kv_budget_makes_the_router_wait_and_reservations_return():
    # each request reserves 6000 of 10000 KV tokens: the second waits until the first ends
    a, b = req(0, 0.0, 5000, 1000), req(1, 0.0, 5000, 1000)
    sim = Simulator(M, Fleet("disaggregated", 1, 1))
    sim.run([a, b], 100.0, drain_s=10_000)
    assert a.end > 0 and b.end > 0
    assert b.first == pytest.approx(a.end + M.prefill_time(5000))     # b was routed when a freed its KV
    assert all(r.kv_reserved == 0 for r in sim.pools["decode"])


def test_continuous_batching_and_max_num_seqs():
    d = DecodeReplica(0, M, 0.0, 0.0)
    reqs = [req(i, 0.0, 10, 3 + i % 2) for i in range(10)]
    for r in reqs:
        r.reserved = r.input_len + r.output_len       # as the simulator's router reserves
        d.kv_reserved += r.reserved
        d.add(r)
    end = d.start(0.0)
    assert d.stepping == 8 and end == pytest.approx(M.step_time(0, 8, 8 * 11))   # at most max_num_seqs
    assert d.end(end) == [] and d.batch.context == 8 * 12
    t = d.start(end)
    done = d.end(t)                              # the 3-token outputs (2 decode steps) end now
    assert sorted(r.id for r in done) == [0, 2, 4, 6]
    t2 = d.start(t)
    assert d.stepping == 6                       # the two waiting sequences joined the running four
    while t2 is not None:
        d.end(t2)
        t2 = d.start(t2)
    assert all(r.end > 0 for r in reqs) and d.kv_reserved == 0 and d.idle()


def test_many_replicas_route_by_sampling_and_every_request_ends():
    reqs = poisson([(0, 200)], 5.0, 64, 8, seed=3)
    sim = Simulator(M, Fleet("disaggregated", 100, 100))
    res = sim.run(reqs, 5.0)
    assert all(r.end > 0 for r in reqs)
    s = summarize(res, 10, 10)
    assert s["finished"] == len(reqs) and s["mean_replicas"] == pytest.approx(200)


def test_slo_scaler_grows_both_pools_on_a_step_and_shrinks_after():
    b = Bounds(1, 50, upscale_delay_s=1, downscale_delay_s=5, warmup_s=5)
    fast = StepModel(5e8, 1e9, 1e5, 1e13, 1e12, 1e9, kv_tokens=100_000, max_num_seqs=4, max_batched_tokens=2048)
    scaler = SloScaler(fast, SloTargets(0.5, 0.02), b, b)
    schedule = [(0.0, 1.0), (30.0, 40.0), (90.0, 1.0)]
    reqs = poisson(schedule, 240.0, 512, 256, seed=1)
    res = Simulator(fast, Fleet("disaggregated", 1, 1, scaler, startup_s=5)).run(reqs, 240.0)
    peak_p = max(p for _, p, _ in res.timeline)
    peak_d = max(d for _, _, d in res.timeline)
    assert peak_p >= 2 and peak_d >= 2
    assert res.timeline[-1][1:] < (peak_p, peak_d)
    downs = [(a[1] - b[1], a[2] - b[2]) for a, b in zip(res.timeline, res.timeline[1:])]
    assert all(dp <= 1 and dd <= 1 for dp, dd in downs)      # one replica at a time on the way down
    assert all(r.end > 0 for r in reqs)


def test_per_pool_scaler_scales_on_queued_tokens():
    b = Bounds(1, 8, upscale_delay_s=0, downscale_delay_s=0, warmup_s=0)
    reqs = poisson([(0.0, 20.0)], 20.0, 1000, 4, seed=2)
    res = Simulator(M, Fleet("disaggregated", 1, 1, PerPoolScaler(b, b, target_queued_tokens=1000),
                             startup_s=1)).run(reqs, 20.0)
    assert max(p for _, p, _ in res.timeline) > 1


def test_load_generation_and_traces(tmp_path):
    assert parse_schedule("0:5,60:50") == [(0.0, 5.0), (60.0, 50.0)]
    with pytest.raises(ValueError):
        parse_schedule("10:5")
    reqs = poisson([(0.0, 50.0)], 100.0, 100, 10, jitter=0.5, seed=0)
    assert abs(len(reqs) - 5000) < 300 and all(50 <= r.input_len <= 150 for r in reqs)
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,input_len,output_len\n1.5,100,10\n0.5,20,2\n")
    assert [(r.arrival, r.input_len) for r in read_trace(p)] == [(0.5, 20), (1.5, 100)]
    p.write_text("1,-1,2\n")
    with pytest.raises(ValueError):
        read_trace(p)


def test_cli_fixed_fleet_policy_and_comparison(tmp_path, capsys):
    assert main(["simulate", "--fleet", "2:1", "--rate", "5", "--duration", "10", "--json",
                 str(tmp_path / "a.json")]) == 0
    assert "| 2:1 |" in capsys.readouterr().out
    assert main(["simulate", "--policy", "slo", "--schedule", "0:1,10:20", "--duration", "30",
                 "--startup-s", "5", "--plot", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").stat().st_size > 0
    assert main(["simulate", "--rates", "1,5", "--duration", "10"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "best P:D" in out
    assert main(["simulate", "--fleet", "x:y"]) == 2
    assert main(["simulate", "--policy", "slo"]) == 2


def test_goodput_counts_only_requests_meeting_both_slos():
    a, b = req(0, 0.0, 10, 3), req(1, 0.0, 10, 3)
    a.first, a.end, b.first, b.end = 0.1, 0.3, 2.0, 2.2
    from pdserve.plan.simulator import Result
    s = summarize(Result([a, b], 10.0, [(0.0, math.inf)]), ttft_slo=1.0, tpot_slo=0.5)
    assert s["goodput"] == pytest.approx(0.1) and s["attainment"] == 0.5 and s["replica_seconds"] == 10.0


def test_validate_against_a_bench_report(capsys):
    from pathlib import Path

    from pdserve.plan.calibrate import calibrate, load_report
    from pdserve.plan.roofline import HARDWARE, MODELS
    report = load_report(Path(__file__).parents[1] / "docs" / "bench_cpu.json")
    assert calibrate(report, MODELS["smollm2-135m"], HARDWARE["h100"], "rate 0.5/s").run.load == 0.5
    with pytest.raises(ValueError):
        calibrate(report, MODELS["smollm2-135m"], HARDWARE["h100"], "rate 7/s")
    assert main(["simulate", "--model", "smollm2-135m", "--hardware", "h100", "--seeds", "2", "--validate",
                 str(Path(__file__).parents[1] / "docs" / "bench_cpu.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("| rate ") == 3 and "worst sim/meas" in out


def test_validate_replays_the_measured_requests_when_the_report_records_them():
    """A bench report whose results carry send times and prompt lengths is replayed exactly: requests
    far apart never queue, so each simulated TTFT is its own prompt's prefill time."""
    from pdserve.plan.sim_validate import validate
    prompts = [100, 300, 200, 400, 250]
    results = [{"ok": True, "ttft": 0.5, "tpot": 0.01, "e2e": 1.0, "tokens": 4, "sent": 30.0 * i, "prompt_tokens": n}
               for i, n in enumerate(prompts)]
    report = {"args": {"url": "u", "compare": None, "input_len": 250, "output_len": 4, "jitter": 0.5,
                       "ttft_slo": 1.0, "tpot_slo": 0.5, "rates": "0.03", "concurrency": None},
              "runs": [{"name": "u rate 0.03/s", "results": results,
                        "summary": {"requests": 5, "failed": 0, "wall_s": 121.0, "req_per_s": 5 / 121,
                                    "output_tok_per_s": 20 / 121, "goodput_req_per_s": 5 / 121, "ttft_p50": 0.5,
                                    "ttft_p90": 0.5, "tpot_p50": 0.01, "tpot_p90": 0.01, "e2e_p50": 1.0}}]}
    (row,) = validate(M, report)
    assert row["how"] == "replayed"
    ttfts = sorted(M.prefill_time(n) for n in prompts)
    assert row["simulated"]["ttft_p50"] == pytest.approx(ttfts[2])
    assert row["simulated"]["ttft_p90"] == pytest.approx(ttfts[4])
    del results[0]["sent"]                                   # an older report: Poisson draws instead
    assert validate(M, report, seeds=2)[0]["how"] == "2 Poisson draws"


# ---- one host's cores shared with the serving work (pdserve/plan/sim_host.py) -------------------------
def test_host_load_shares_the_cores_and_reprices_running_steps():
    from types import SimpleNamespace as R

    from pdserve.plan.sim_host import HostCpu, HostLoad
    a, b = R(id=1), R(id=2)
    load = HostLoad(HostCpu(cores=2, token_cpu=0.01, loop_token_cpu=0.002, base_cores=0.5))
    assert load.start(0.0, a, 0.1, 0) == [(pytest.approx(0.1), a)]           # 1 engine + 0.5 cores <= 2
    ends = {r.id: t for t, r in load.start(0.0, b, 0.1, 4)}          # 2.5 cores: both at 0.8
    assert ends == {1: pytest.approx(0.125), 2: pytest.approx((0.1 + 4 * 0.002) / 0.8)}
    (end_b,) = load.finish(0.125, a)                                        # b has 0.008 s left, alone now
    assert end_b == (pytest.approx(0.133), b)
    load.finish(0.133, b)
    load.emitted(0.133, 100)                                                 # 100 tokens/s at tau 1 s: +1 core
    assert load.start(0.133, a, 0.1, 0)[0][0] == pytest.approx(0.133 + 0.1 * 2.5 / 2)   # 1 + 1 + 0.5 cores
    load.finish(0.2, a)
    assert load.start(50.0, a, 0.1, 0)[0][0] == pytest.approx(50.1)          # the rate decayed away
    with pytest.raises(ValueError):
        HostCpu(cores=2, token_cpu=0.001, loop_token_cpu=0.002)


def test_host_load_decode_steps_beside_another_engine_slow_by_the_measured_interference(tmp_path):
    import json
    from types import SimpleNamespace as R

    from pdserve.plan.sim_host import HostCpu, HostLoad
    (tmp_path / "ci.json").write_text(json.dumps({"decode": {"slowdown": 2.0}, "prefill": {"slowdown": 3.0}}))
    host = HostCpu(cores=4).with_interference(tmp_path / "ci.json")
    prefill, decode, decode2 = R(id=1), R(id=2), R(id=3)
    load = HostLoad(host)
    assert load.start(0.0, decode, 0.1, 1) == [(pytest.approx(0.1), decode)]      # alone: full speed
    load.finish(0.1, decode)
    load.start(0.1, prefill, 0.3, 0)
    ends = {r.id: t for t, r in load.start(0.1, decode, 0.1, 1)}
    assert ends == {1: pytest.approx(0.4), 2: pytest.approx(0.3)}                 # prefill is not slowed
    assert load.finish(0.3, decode) == [(pytest.approx(0.4), prefill)]
    assert {r.id: t for t, r in load.start(0.3, decode2, 0.05, 2)} == {1: pytest.approx(0.4), 3: pytest.approx(0.4)}


def test_host_cpu_fits_a_least_squares_line_through_the_runs(tmp_path):
    import json

    from pdserve.plan.sim_host import HostCpu

    def run(rate, tok_s, serving_cores, loop_cores):
        cores = {"prefill engine": 0.3, "prefill rest": 0.0, "decode engine": 0.4, "decode rest": loop_cores,
                 "router": serving_cores - loop_cores, "proxy": 0.0, "client": 0.0, "ray": 0.1}
        return {"rate": rate, "tokens": tok_s * 10, "wall_s": 10.0, "cores": cores}
    path = tmp_path / "host.json"
    # serving = 0.05 + 0.004 s/token, the two low runs 0.01 cores off it (through them alone the slope
    # would be 0.002); the loop 0.01 + 0.001 s/token
    path.write_text(json.dumps({"cpus": 2, "runs": [run(4, 200, 0.85, 0.21), run(1, 20, 0.12, 0.03),
                                                    run(0.5, 10, 0.10, 0.02)]}))
    h = HostCpu.from_measurement(path)
    assert (h.cores, h.token_cpu, h.loop_token_cpu) == (2, pytest.approx(0.004, abs=1e-4), pytest.approx(0.001))
    assert h.base_cores == pytest.approx(0.05 + 0.1, abs=2e-3)
    path.write_text(json.dumps({"cpus": 2, "runs": [run(1, 20, 0.13, 0.03)]}))
    with pytest.raises(ValueError, match="two or more rates"):
        HostCpu.from_measurement(path)


def test_shared_host_makes_tpot_grow_with_load_where_own_devices_keep_it_flat():
    from pdserve.plan.sim_host import HostCpu
    host = HostCpu(cores=2, token_cpu=0.004, loop_token_cpu=0.001, base_cores=0.1)

    m = StepModel(**{**M.__dict__, "mem_bw": 1e11})     # decode steps ~10 ms, memory-bound up to batch 8

    def tpot(rate, h):
        reqs = poisson([(0.0, rate)], 60, 200, 64, 0.0, seed=3)
        Simulator(m, Fleet("disaggregated", 1, 1), 0, host=h).run(reqs, 60)
        return summarize_tpot(reqs)
    alone = [tpot(r, None) for r in (0.2, 3)]
    shared = [tpot(r, host) for r in (0.2, 3)]
    assert alone[1] / alone[0] < 1.1                     # batching is nearly free on a device of its own
    assert shared[0] < alone[0] * 1.2 and shared[1] > alone[1] * 1.25


def summarize_tpot(reqs):
    done = sorted(r.tpot for r in reqs if r.end >= 0)
    return done[len(done) // 2]


def test_calibration_by_simulation_reproduces_the_calibration_run():
    from pdserve.plan.sim_host import HostCpu
    from pdserve.plan.sim_validate import calibrate_by_simulation, validate
    results = [{"ok": True, "ttft": 0.3, "tpot": 0.01, "e2e": 1.0, "tokens": 8, "sent": 0.7 * i,
                "prompt_tokens": 200 + 37 * (i % 5)} for i in range(40)]
    summary = {"requests": 40, "failed": 0, "wall_s": 30.0, "req_per_s": 1.3, "output_tok_per_s": 10,
               "goodput_req_per_s": 1.3, "ttft_p50": 0.004, "ttft_p90": 0.005, "tpot_p50": 0.003,
               "tpot_p90": 0.004, "e2e_p50": 0.03}
    report = {"args": {"url": "u", "input_len": 250, "output_len": 8, "jitter": 0.2, "ttft_slo": 1.0,
                       "tpot_slo": 0.5}, "runs": [{"name": "u rate 1.4/s", "results": results, "summary": summary}]}
    host = HostCpu(cores=1.5, token_cpu=0.002, loop_token_cpu=0.0005, base_cores=0.2)
    memory_bound = StepModel(**{**M.__dict__, "mem_bw": 1e11, "link_bw": 1e12})   # decode memory-, prefill compute-bound
    m = calibrate_by_simulation(memory_bound, report, host)
    (row,) = validate(m, report, host=host)
    assert row["simulated"]["ttft_p50"] == pytest.approx(0.004, rel=0.02)
    assert row["simulated"]["tpot_p50"] == pytest.approx(0.003, rel=0.02)
    assert m.prefill_eff > 10 and m.decode_eff > 1      # both moved: the targets are far from the start


def test_cli_host_cpu_needs_one_host_to_simulate(tmp_path, capsys):
    (tmp_path / "h.json").write_text("{}")
    assert main(["simulate", "--model", "smollm2-135m", "--host-cpu", str(tmp_path / "h.json")]) == 2
    assert "host_cpu.py report" in capsys.readouterr().err
    docs = Path(__file__).parents[1] / "docs"
    assert main(["simulate", "--model", "smollm2-135m", "--host-cpu", str(docs / "host_cpu.json")]) == 2
    assert "with --fleet, --policy or --validate" in capsys.readouterr().err
    assert main(["simulate", "--model", "smollm2-135m", "--fleet", "1:1",
                 "--host-interference", str(docs / "core_interference.json")]) == 2
    assert "needs --host-cpu" in capsys.readouterr().err


def test_cli_validates_this_host_s_measurement_with_its_host_model(capsys):
    """The README's table: the measured sweep replayed on one shared host, calibrated by simulation on
    its lowest rate, which the simulation then reproduces."""
    docs = Path(__file__).parents[1] / "docs"
    assert main(["simulate", "--model", "smollm2-135m", "--hardware", "h100", "--max-batched-tokens", "512",
                 "--max-num-seqs", "64", "--kv-tokens", "23301", "--validate", str(docs / "bench_cpu_validate.json"),
                 "--host-cpu", str(docs / "host_cpu.json"),
                 "--host-interference", str(docs / "core_interference.json")]) == 0
    out = capsys.readouterr().out
    assert "one host: 2 cores" in out and "calibrated by simulation" in out
    first = next(line for line in out.splitlines() if line.startswith("| rate 0.5/s"))
    (ttft_meas, ttft_sim), _, (tpot_meas, tpot_sim) = [c.split(" / ") for c in first.split("|")[2:5]]
    assert abs(float(ttft_sim) / float(ttft_meas) - 1) < 0.03 and abs(float(tpot_sim) / float(tpot_meas) - 1) < 0.06


def test_a_cached_prefix_is_prefilled_sent_and_reserved_only_past_it():
    # 5000-token prompts whose first 4000 every replica holds: the prefill computes 1000 (two
    # chunks), the hand-off sends 1000, the decode replica reserves 1000 + output; steps read all
    r = Request(0, 0.0, 5000, 5, cached=4000)
    assert (r.new_tokens, r.kv_tokens) == (1000, 1005)
    sim = Simulator(M, Fleet("disaggregated", 1, 1))
    sim.run([r], 100.0)
    assert r.ttft == pytest.approx(2 * M.step_time(500))
    steps = sum(M.step_time(0, 1, 5001 + k) for k in range(4))
    assert r.end - r.first == pytest.approx(1e5 * 1000 / 1e9 + steps)
    assert all(d.kv_reserved == 0 for d in sim.pools["decode"])
    # test_kv_budget_...'s requests: with the prefix held once (the replica's KV less 4000, as
    # `simulate --cached-len` sets it), two now fit side by side (2 x 2000 of 6000)
    a, b = (Request(i, 0.0, 5000, 1000, cached=4000) for i in range(2))
    Simulator(dataclasses.replace(M, kv_tokens=6000), Fleet("disaggregated", 1, 1)).run([a, b], 100.0,
                                                                                         drain_s=10_000)
    assert b.first < a.end


def test_a_short_tail_past_the_cached_prefix_is_prefilled_by_the_decode_replica():
    """Local prefill (`Fleet.local_prefill_tokens`, pdserve's routing.local_prefill_tokens): 40
    tokens past a prefix the replicas hold run in the decode replica's own step, no prefill replica,
    no hand-off; a second such prompt arriving while the first is queued there would exceed the
    limit with it, so it is handed off; the SLO scaler's window sees the local one."""
    b = Bounds(1, 4)
    scaler = SloScaler(M, SloTargets(1.0, 0.1), b, b, window_s=10.0)
    sim = Simulator(M, Fleet("disaggregated", 1, 1, scaler, local_prefill_tokens=64))
    r, s = Request(0, 0.0, 5000, 5, cached=4960), Request(1, 0.0, 5000, 5, cached=4960)
    sim.run([r, s], 100.0)
    assert r.ttft == pytest.approx(M.step_time(40))                     # one step of the decode replica
    # no transfer: r decodes at once, alone for three steps (s's K/V lands at 44 ms), then beside s
    steps = sum(M.step_time(0, 1, 5001 + k) for k in range(3)) + M.step_time(0, 2, 5004 + 5001)
    assert r.end - r.first == pytest.approx(steps)
    assert s.ttft == pytest.approx(M.step_time(40))                    # the prefill replica's step
    assert s.end > s.first + 1e5 * 40 / 1e9                            # after its K/V's hand-off
    assert all(d.kv_reserved == 0 and d.idle() for d in sim.pools["decode"])
    assert scaler.observation(sim, 6.0).local_rate == pytest.approx(1 / 6) and scaler.locals[0][1] == 40
    # without the setting, or without a cached prefix, both are handed off
    for fleet, cached in ((Fleet("disaggregated", 1, 1), 4960),
                          (Fleet("disaggregated", 1, 1, local_prefill_tokens=64), 0)):
        a = Request(0, 0.0, 40 + cached, 5, cached=cached)
        Simulator(M, fleet).run([a], 100.0)
        assert a.end - a.first > 1e5 * 40 / 1e9


def test_the_cached_prefix_is_checked_against_the_prompts(tmp_path, capsys):
    reqs = poisson([(0.0, 5.0)], 10.0, 1000, 10, jitter=0.2, seed=0, cached=700)
    assert reqs and all(r.cached == 700 and r.new_tokens == r.input_len - 700 for r in reqs)
    with pytest.raises(ValueError, match="shortest prompt"):
        poisson([(0.0, 5.0)], 10.0, 1000, 10, jitter=0.2, cached=800)
    p = tmp_path / "t.csv"
    p.write_text("0.5,300,2\n1.0,100,2\n")
    with pytest.raises(ValueError, match="cached prefix"):
        read_trace(p, cached=100)
    assert [r.new_tokens for r in read_trace(p, cached=99)] == [201, 1]
    assert main(["simulate", "--fleet", "1:1", "--rate", "2", "--duration", "5", "--input-len", "1000",
                 "--cached-len", "900"]) == 2
    assert "shortest prompt" in capsys.readouterr().err
    assert main(["simulate", "--fleet", "1:1", "--rate", "2", "--duration", "5", "--input-len", "1000",
                 "--cached-len", "700"]) == 0
    assert "beside a 700-token shared prefix" in capsys.readouterr().out


def test_a_windowed_batch_keeps_the_sum_of_its_sequences_windows_step_by_step():
    """The decode batch's `windowed` (the sum of min(context, window), kept in O(log B) a step)
    equals the sum over its running sequences at every step, as they join, cross the window and
    end; a step is priced at what a windowed layer reads."""
    import random
    window = 40
    m = dataclasses.replace(M, window=window, window_share=0.75, max_num_seqs=6)
    d = DecodeReplica(0, m, 0.0, 0.0)
    rng, context, t = random.Random(5), {}, 0.0
    reqs = [req(i, 0.0, rng.randrange(1, 60), rng.randrange(2, 50)) for i in range(30)]
    for r in reqs:
        r.reserved = m.held_tokens(r.kv_tokens, r.new_tokens)
        d.add(r)
    crossed = 0
    while (end := d.start(t)) is not None:
        for r in d.pending:
            context.pop(r.id, None)
        for _, rid, r in d.batch.heap:
            context.setdefault(rid, r.input_len + 1)
        assert d.batch.windowed == sum(min(c, window) for c in context.values())
        assert end - t == pytest.approx(m.step_time(0, d.stepping, sum(context.values()) - 0.75 * sum(
            max(c - window, 0) for c in context.values())))
        crossed += any(c == window for c in context.values())
        for r in d.end(end):
            del context[r.id]
        context = {rid: c + 1 for rid, c in context.items()}
        t = end
    assert crossed and not context and d.batch.windowed == 0 and not d.batch.growing
    assert all(r.end > 0 for r in reqs)


def test_a_model_windowed_on_every_layer_reserves_about_its_window_and_gets_through_more():
    """Simulated, 2k prompts and 512 outputs under a KV budget of 20k tokens: without a window 7
    sequences fit the decode replica (2560 tokens each); with a 1k window on every layer each
    reserves its prompt only (the outputs come within the blocks the window gives back), 9 fit, and
    each step reads a 1k window: the load ends sooner."""
    base = dataclasses.replace(M, kv_tokens=20_000, max_num_seqs=64)
    windowed = dataclasses.replace(base, window=1024, window_share=1.0)
    results = {}
    for name, m in (("full", base), ("window", windowed)):
        res = Simulator(m, Fleet("disaggregated", 40, 1)).run([req(i, 0.0, 2048, 512) for i in range(40)], 100.0,
                                                             drain_s=10_000)
        assert all(r.end > 0 for r in res.requests)
        spans = sorted([(r.first, 1) for r in res.requests] + [(r.end, -1) for r in res.requests])
        results[name] = res, max(itertools.accumulate(step for _, step in spans))   # most decoding at once
    full, window = results["full"][0], results["window"][0]
    assert (results["full"][1], results["window"][1]) == (7, 9)
    assert max(r.end for r in window.requests) < max(r.end for r in full.requests)
