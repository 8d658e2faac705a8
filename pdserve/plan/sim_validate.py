"""`pdserve simulate --validate BENCH_JSON`: the simulator against a measured `pdserve bench` report.

For each open-loop run of the report's primary endpoint (offered rate R, N requests, the bench's prompt
lengths and jitter): simulate the same N Poisson requests at R on a 1 prefill : 1 decode fleet, `seeds`
times with different seeds, and compare the pooled TTFT/TPOT p50/p90 and the mean goodput (computed as
the bench does: requests meeting both SLOs / wall time from the first send to the last token) with the
measurement. The model's efficiencies come from the same report's lowest-load run (`--calibrate`), so
that run agrees by construction on the p50s; the others are predictions.
"""

from __future__ import annotations

from pdserve.plan.calibrate import run_points
from pdserve.plan.sim_load import poisson
from pdserve.plan.sim_report import percentile
from pdserve.plan.simulator import Fleet, Simulator
from serving.slo_model import StepModel


def simulate_run(m: StepModel, rate: float, n: int, input_len: int, output_len: int, jitter: float,
                 ttft_slo: float, tpot_slo: float, seeds: int = 20, fleet: tuple[int, int] = (1, 1)) -> dict:
    ttft, tpot, goodput = [], [], []
    for seed in range(seeds):
        reqs = []
        while len(reqs) < n:          # 20 mean inter-arrival times beyond n / rate: n arrivals are all but sure
            reqs = poisson([(0.0, rate)], (n + 20 + 5 * n ** 0.5) / rate, input_len, output_len, jitter, seed)
            seed += 1000
        reqs = reqs[:n]
        Simulator(m, Fleet("disaggregated", *fleet), seed).run(reqs, reqs[-1].arrival, drain_s=3600)
        ttft += [r.ttft for r in reqs]
        tpot += [r.tpot for r in reqs]
        good = sum(r.ttft <= ttft_slo and r.tpot <= tpot_slo for r in reqs)
        goodput.append(good / max(r.end for r in reqs))
    return {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "tpot_p50": percentile(tpot, 50),
            "tpot_p90": percentile(tpot, 90), "goodput_req_per_s": sum(goodput) / len(goodput)}


def validate(m: StepModel, report: dict, seeds: int = 20) -> list[dict]:
    a = report["args"]
    rows = []
    for p in run_points(report):
        run = next(r for r in report["runs"] if r["name"] == p.name)
        if " rate " not in p.name:
            continue
        meas = run["summary"]
        sim = simulate_run(m, p.load, meas["requests"], a["input_len"], a["output_len"], a.get("jitter", 0.0),
                           a["ttft_slo"], a["tpot_slo"], seeds)
        rows.append({"run": p.name, "measured": meas, "simulated": sim})
    return rows


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
        out.append(f"| {r['run'].rsplit(' ', 2)[-2:][0]} {r['run'].rsplit(' ', 1)[-1]} | " + " | ".join(cells)
                   + f" | {worst:.2f} |")
    return "\n".join(out)
