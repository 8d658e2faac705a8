"""`pdserve simulate --validate BENCH_JSON`: the simulator against a measured `pdserve bench` report.

For each open-loop run of the report's primary endpoint: simulate it on a 1 prefill : 1 decode fleet and
compare TTFT/TPOT p50/p90 and goodput (computed as the bench does: requests meeting both SLOs / wall
time from the first send to the last token) with the measurement. A report whose results record each
request's send time and prompt length (`pdserve bench` does) is replayed exactly: the same arrivals and
lengths, so the comparison is of the system, not of two Poisson draws; an older report gets the same
N requests drawn at its rate R with its lengths and jitter, `seeds` times, percentiles pooled and
goodput averaged. The model's efficiencies come from the same report's lowest-load run (`--calibrate`), so
that run agrees by construction on the p50s; the others are predictions.

With a host model (`--host-cpu`, pdserve/plan/sim_host.py) the roofline calibration would count the
host's costs at the calibration load twice, so the efficiencies are found by simulation instead
(`calibrate_by_simulation`): those under which the simulated calibration run, host costs included,
reproduces its measured TTFT and TPOT p50.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.plan.calibrate import run_points
from pdserve.plan.sim_host import HostCpu
from pdserve.plan.sim_load import Request, poisson
from pdserve.plan.sim_report import percentile
from pdserve.plan.simulator import Fleet, Simulator
from serving.slo_model import StepModel


def simulate_run(m: StepModel, rate: float, n: int, input_len: int, output_len: int, jitter: float,
                 ttft_slo: float, tpot_slo: float, seeds: int = 20, fleet: tuple[int, int] = (1, 1),
                 host: HostCpu | None = None) -> dict:
    ttft, tpot, goodput = [], [], []
    for seed in range(seeds):
        reqs = []
        while len(reqs) < n:          # 20 mean inter-arrival times beyond n / rate: n arrivals are all but sure
            reqs = poisson([(0.0, rate)], (n + 20 + 5 * n ** 0.5) / rate, input_len, output_len, jitter, seed)
            seed += 1000
        reqs = reqs[:n]
        Simulator(m, Fleet("disaggregated", *fleet), seed, host=host).run(reqs, reqs[-1].arrival, drain_s=3600)
        ttft += [r.ttft for r in reqs]
        tpot += [r.tpot for r in reqs]
        good = sum(r.ttft <= ttft_slo and r.tpot <= tpot_slo for r in reqs)
        goodput.append(good / max(r.end for r in reqs))
    return {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "tpot_p50": percentile(tpot, 50),
            "tpot_p90": percentile(tpot, 90), "goodput_req_per_s": sum(goodput) / len(goodput)}


def replay_run(m: StepModel, results: list[dict], output_len: int, ttft_slo: float, tpot_slo: float,
               fleet: tuple[int, int] = (1, 1), host: HostCpu | None = None) -> dict:
    """The measured run's own requests (send time, prompt length, `output_len` tokens), simulated once."""
    reqs = [Request(i, r["sent"], r["prompt_tokens"], output_len)
            for i, r in enumerate(sorted(results, key=lambda r: r["sent"]))]
    Simulator(m, Fleet("disaggregated", *fleet), 0, host=host).run(reqs, reqs[-1].arrival, drain_s=3600)
    ttft, tpot = [r.ttft for r in reqs], [r.tpot for r in reqs]
    good = sum(r.ttft <= ttft_slo and r.tpot <= tpot_slo for r in reqs)
    return {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "tpot_p50": percentile(tpot, 50),
            "tpot_p90": percentile(tpot, 90), "goodput_req_per_s": good / max(r.end for r in reqs)}


def _simulate(m: StepModel, report: dict, rate: float, run: dict, seeds: int,
              host: HostCpu | None) -> tuple[dict, str]:
    """One open-loop run of the report (offered `rate`) simulated: (summary, how)."""
    a, meas, results = report["args"], run["summary"], run.get("results") or []
    if results and all("sent" in r and "prompt_tokens" in r for r in results):
        return replay_run(m, results, a["output_len"], a["ttft_slo"], a["tpot_slo"], host=host), "replayed"
    return simulate_run(m, rate, meas["requests"], a["input_len"], a["output_len"], a.get("jitter", 0.0),
                        a["ttft_slo"], a["tpot_slo"], seeds, host=host), f"{seeds} Poisson draws"


def _open_loop_runs(report: dict) -> list[tuple[float, dict]]:
    """(offered rate, run) of the primary endpoint's open-loop runs, lowest rate first."""
    by_name = {r["name"]: r for r in report["runs"]}
    return [(p.load, by_name[p.name]) for p in run_points(report) if " rate " in p.name]


def calibrate_by_simulation(m: StepModel, report: dict, host: HostCpu, run: str | None = None, seeds: int = 20,
                            rounds: int = 8) -> StepModel:
    """`m` with the efficiencies under which the simulated calibration run (the lowest-rate open-loop run,
    or the one whose name ends with `run`) reproduces its measured TTFT and TPOT p50 on `host`: a
    fixed point of eff *= simulated / measured, from `m`'s efficiencies."""
    runs = [(rate, r) for rate, r in _open_loop_runs(report) if run is None or r["name"].endswith(run)]
    if not runs:
        raise ValueError(f"no open-loop run of the bench report ends with {run!r}")
    rate, chosen = runs[0]
    meas = chosen["summary"]
    for _ in range(rounds):
        sim, _how = _simulate(m, report, rate, chosen, seeds, host)
        m = replace(m, prefill_eff=m.prefill_eff * sim["ttft_p50"] / meas["ttft_p50"],
                    decode_eff=m.decode_eff * sim["tpot_p50"] / meas["tpot_p50"])
    return m


def validate(m: StepModel, report: dict, seeds: int = 20, host: HostCpu | None = None) -> list[dict]:
    return [{"run": run["name"], "measured": run["summary"], "how": how, "simulated": sim}
            for rate, run in _open_loop_runs(report) for sim, how in [_simulate(m, report, rate, run, seeds, host)]]


KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput_req_per_s")


def table(rows: list[dict]) -> str:
    out = ["| run | TTFT p50 ms meas / sim | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | goodput req/s | "
           "worst sim/meas |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells, worst = [], 1.0
        for k in KEYS:
            mv, sv = r["measured"][k], r["simulated"][k]
            scale = 1 if k.startswith("goodput") else 1e3
            cells.append(f"{mv * scale:.{2 if scale == 1 else 0}f} / {sv * scale:.{2 if scale == 1 else 0}f}")
            if mv and sv:
                ratio = sv / mv
                worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
        how = f" ({r['how']})" if r.get("how") else ""
        out.append(f"| {r['run'].rsplit(' ', 2)[-2:][0]} {r['run'].rsplit(' ', 1)[-1]}{how} | " + " | ".join(cells)
                   + f" | {worst:.2f} |")
    return "\n".join(out)
