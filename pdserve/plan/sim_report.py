"""Summaries of a simulation: latency percentiles, goodput under SLOs, replica-seconds (plain Python)."""

from __future__ import annotations

from pdserve.plan.roofline import Hardware, ModelSpec
from pdserve.plan.simulator import Result, replica_seconds
from serving.slo_model import StepModel


def step_model(m: ModelSpec, hw: Hardware, prefill_eff: float = 1.0, decode_eff: float = 1.0,
               kv_tokens: int | None = None, max_num_seqs: int = 256, max_batched_tokens: int = 8192) -> StepModel:
    """The simulator's per-replica model from the planner's spec: KV budget default = 90 % of the
    device's memory beside the weights (as `plan` assumes)."""
    kv = kv_tokens or int((hw.mem_bytes * 0.9 - m.weight_bytes) // m.kv_bytes_per_token)
    if kv <= 0:
        raise ValueError(f"{m.name} does not fit on {hw.name}: no KV memory left beside the weights")
    return StepModel(m.active_params, m.weight_bytes, m.kv_bytes_per_token, hw.peak_flops, hw.mem_bw, hw.link_bw,
                     prefill_eff, decode_eff, kv, max_num_seqs, max_batched_tokens, m.window, m.window_share,
                     m.expert_params * m.dtype_bytes, m.experts, m.experts_per_token)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(res: Result, ttft_slo: float, tpot_slo: float, since: float = 0.0) -> dict:
    """p50/p90 TTFT and TPOT of the finished requests that arrived in [since, duration); goodput =
    those meeting both SLOs per second of that window; replica-seconds within it."""
    window = res.duration - since
    reqs = [r for r in res.requests if r.arrival >= since]
    done = [r for r in reqs if r.end >= 0]
    ttft, tpot = [r.ttft for r in done], [r.tpot for r in done if r.output_len > 1]
    good = sum(r.ttft <= ttft_slo and (r.output_len <= 1 or r.tpot <= tpot_slo) for r in done)
    spent = replica_seconds(res, since)
    mean_replicas = spent / window if window > 0 else 0.0
    return {"requests": len(reqs), "finished": len(done),
            "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90),
            "tpot_p50": percentile(tpot, 50), "tpot_p90": percentile(tpot, 90),
            "goodput": good / window if window > 0 else 0.0,
            "attainment": good / len(reqs) if reqs else 1.0,
            "replica_seconds": spent, "mean_replicas": mean_replicas,
            "goodput_per_replica": (good / window) / mean_replicas if mean_replicas else 0.0}
