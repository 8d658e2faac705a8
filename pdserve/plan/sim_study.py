"""Fleet comparisons for `pdserve simulate`: colocated N vs the best P:D split vs both autoscalers.

At each offered rate (Poisson, `Study` lengths):
  1. colocated: the least N whose SLO attainment (requests meeting both SLOs / requests) reaches `target`;
  2. best split: the least P (decode generous) meeting the target, then the least D at that P, then
     P and D grown alternately until the pair meets it (the pools interact only through the router's
     KV reservations, so this finds the least P + D in practice);
  3. SLO policy and per-pool policies: start at 1:1 under a load rising in 5 steps to the rate over
     2 x `duration`, then held for `duration`, and scale themselves (new replicas serve after
     `startup_s`); measured over the held part.
Searches double, then bisect; each probe is one simulation of `duration` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.plan.sim_load import poisson
from pdserve.plan.sim_report import summarize
from pdserve.plan.sim_scaling import Bounds, PerPoolScaler, SloScaler
from pdserve.plan.simulator import Fleet, Simulator
from serving.slo_model import StepModel, Workload, decode_batch, size_fleet
from serving.slo_policy import SloTargets


@dataclass(frozen=True)
class Study:
    input_len: int
    output_len: int
    ttft_slo: float
    tpot_slo: float
    duration: float = 60.0
    jitter: float = 0.2
    target: float = 0.9            # SLO attainment a fixed fleet must reach
    startup_s: float = 30.0
    max_replicas: int = 1000
    seed: int = 0
    cached_len: int = 0            # a prefix of every prompt that every replica holds (sim_load)
    local_prefill_tokens: int = 0  # Fleet.local_prefill_tokens (pdserve's routing.local_prefill_tokens)


def simulate(m: StepModel, s: Study, rate: float, fleet: Fleet, since: float = 0.0) -> dict:
    reqs = poisson([(0.0, rate)], s.duration, s.input_len, s.output_len, s.jitter, s.seed, s.cached_len)
    return summarize(Simulator(m, fleet, s.seed).run(reqs, s.duration), s.ttft_slo, s.tpot_slo, since)


def least(ok, lo: int, hi: int) -> int | None:
    """The least n in [lo, hi] with ok(n) (ok monotone), or None."""
    n = max(lo, 1)
    while not ok(n):
        if n >= hi:
            return None
        lo, n = n + 1, min(2 * n, hi)
    while lo < n:
        mid = (lo + n) // 2
        if ok(mid):
            n = mid
        else:
            lo = mid + 1
    return n


def colocated(m: StepModel, s: Study, rate: float) -> tuple[int | None, dict | None]:
    def ok(n):
        return simulate(m, s, rate, Fleet("colocated", n))["attainment"] >= s.target
    n = least(ok, 1, s.max_replicas)
    return n, (simulate(m, s, rate, Fleet("colocated", n)) if n else None)


def best_split(m: StepModel, s: Study, rate: float) -> tuple[tuple[int, int] | None, dict | None]:
    sized = size_fleet(m, Workload(rate, s.input_len, s.output_len), s.ttft_slo, s.tpot_slo)
    generous = min(s.max_replicas, 2 * max(sized.prefill, sized.decode, 1) + 2)

    def run(p, d):
        return simulate(m, s, rate, Fleet("disaggregated", p, d, local_prefill_tokens=s.local_prefill_tokens))
    p = least(lambda p: run(p, generous)["attainment"] >= s.target, 1, s.max_replicas)
    if p is None:
        return None, None
    d = least(lambda d: run(p, d)["attainment"] >= s.target, 1, s.max_replicas)
    if d is None:
        return None, None
    for _ in range(8):
        r = run(p, d)
        if r["attainment"] >= s.target:
            return (p, d), r
        p, d = (p + 1, d) if r["ttft_p90"] and r["ttft_p90"] > s.ttft_slo else (p, d + 1)
    return None, None


def ramp(rate: float, duration: float, steps: int = 5) -> list[tuple[float, float]]:
    """The load of an autoscaled run: up to `rate` in `steps` equal steps over `duration`, then held."""
    return [(duration * i / steps, rate * (i + 1) / steps) for i in range(steps)]


def make_scaler(m: StepModel, s: Study, policy: str, utilization: float = 0.8):
    """The SLO scaler, or the per-pool one with targets tuned to the SLOs: a prefill replica's queue
    target is the prompt tokens it prefills in half the TTFT SLO; a decode replica's running target is
    `utilization` x the largest batch meeting the TPOT SLO (the defaults in serving/config.py are
    sized for the CPU)."""
    b = Bounds(1, s.max_replicas, upscale_delay_s=2.0, downscale_delay_s=20.0, warmup_s=s.startup_s)
    if policy == "slo":
        return SloScaler(m, SloTargets(s.ttft_slo, s.tpot_slo, utilization), b, b)
    w = Workload(1.0, s.input_len, s.output_len)
    tokens_per_s = s.input_len / m.prefill_time(s.input_len)
    batch = max(1, decode_batch(m, w, s.tpot_slo))
    return PerPoolScaler(b, b, target_queued_tokens=max(1.0, tokens_per_s * s.ttft_slo / 2),
                         target_running=max(1.0, utilization * batch))


def autoscaled(m: StepModel, s: Study, rate: float, policy: str, utilization: float = 0.8,
               schedule: list[tuple[float, float]] | None = None, duration: float | None = None):
    """A run that starts at 1:1 and scales with `policy` ('slo' or 'per-pool') under `schedule` (default:
    `ramp` to `rate` over 2 x `s.duration`, then `s.duration` held, measured over the held part)."""
    scaler = make_scaler(m, s, policy, utilization)
    fleet = Fleet("disaggregated", 1, 1, scaler, startup_s=s.startup_s, local_prefill_tokens=s.local_prefill_tokens)
    duration = duration or 3 * s.duration
    reqs = poisson(schedule or ramp(rate, 2 * s.duration), duration, s.input_len, s.output_len, s.jitter, s.seed,
                   s.cached_len)
    res = Simulator(m, fleet, s.seed).run(reqs, duration)
    return summarize(res, s.ttft_slo, s.tpot_slo, since=0.0 if schedule else 2 * s.duration), res


def compare(m: StepModel, s: Study, rates: list[float], log=print) -> list[dict]:
    """One row per rate: replicas and goodput per replica of each way to run the fleet."""
    rows = []
    for rate in rates:
        n, co = colocated(m, s, rate)
        split, pd = best_split(m, s, rate)
        slo, slo_res = autoscaled(m, s, rate, "slo")
        pp, pp_res = autoscaled(m, s, rate, "per-pool")
        last = slo_res.timeline[-1] if slo_res.timeline else (0, 0, 0)
        row = {"rate": rate, "colocated": n, "colocated_gpr": co["goodput_per_replica"] if co else 0.0,
               "split": split, "split_gpr": pd["goodput_per_replica"] if pd else 0.0,
               "slo_final": (last[1], last[2]), "slo_mean_replicas": slo["mean_replicas"],
               "slo_attainment": slo["attainment"], "slo_gpr": slo["goodput_per_replica"],
               "perpool_mean_replicas": pp["mean_replicas"], "perpool_attainment": pp["attainment"],
               "perpool_gpr": pp["goodput_per_replica"]}
        log(table_row(row))
        rows.append(row)
    return rows


HEADER = ("| rate req/s | colocated N | goodput/replica | best P:D | goodput/replica | SLO policy P:D (mean replicas) "
          "| attainment | goodput/replica | per-pool (mean replicas) | attainment | goodput/replica |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    split = f"{r['split'][0]}:{r['split'][1]}" if r["split"] else "none"
    return (f"| {r['rate']:g} | {r['colocated'] or 'none'} | {r['colocated_gpr']:.2f} | {split} | {r['split_gpr']:.2f} "
            f"| {r['slo_final'][0]}:{r['slo_final'][1]} ({r['slo_mean_replicas']:.1f}) | {r['slo_attainment']:.2f} "
            f"| {r['slo_gpr']:.2f} | ({r['perpool_mean_replicas']:.1f}) | {r['perpool_attainment']:.2f} "
            f"| {r['perpool_gpr']:.2f} |")


def recommend(rows: list[dict]) -> str:
    """The recommended deployment at the highest rate: the fixed fleet with the best goodput per replica."""
    r = rows[-1]
    if not r["split"] and not r["colocated"]:
        return f"at {r['rate']:g} req/s no fleet within max_replicas meets the SLOs"
    if r["split"] and r["split_gpr"] >= r["colocated_gpr"]:
        return (f"at {r['rate']:g} req/s: {r['split'][0]} prefill : {r['split'][1]} decode replicas "
                f"({r['split_gpr']:.2f} good req/s per replica; colocated needs {r['colocated']})")
    return (f"at {r['rate']:g} req/s: {r['colocated']} colocated replicas ({r['colocated_gpr']:.2f} good req/s "
            f"per replica; the best split is {r['split']})")
