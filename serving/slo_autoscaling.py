"""The SLO autoscaling policy: one Ray Serve application-level policy sizing both pools together.

Serve (2.60) calls an application-level policy on every control-loop tick with every autoscaled
deployment's `AutoscalingContext` and applies, per deployment, the bounds and upscale/downscale
delays of that deployment's `autoscaling_config` to what it returns (`_apply_app_level_autoscaling_config`).
What `SloPolicy.__call__` does each tick:
  1. read the router's window (`ROUTER_METRICS`, reported by the router's `record_autoscaling_stats`;
     the router is autoscaled with min = max = 1 only so that Serve collects them), the prefill
     replicas' queued prompt tokens and the decode replicas' waiting sequences into an `Observation`;
     none yet: hold both pools;
  2. `serving.slo_policy.decide` (model correction, sizing, one-step scale-down with hysteresis, no
     scale-down while a replica younger than `warmup_s` exists);
  3. clamp to each pool's capacity-adjusted min/max and return {prefill id: P, decode id: D} with
     the correction factors and the reason in the prefill pool's policy state; a count other than
     the pool's current one, and an SLO no count can meet, go to Serve's controller log once
     (`serving.autoscaling.log_scaling`).
Draining is Serve's: a decode replica being removed stops receiving requests and finishes its streams
(`graceful_shutdown_timeout_s`). The per-replica model arrives as `model` (StepModel fields as plain
numbers, policy_kwargs must be JSON); pdserve/serve_config.py builds it from the planner.
"""

from __future__ import annotations

from serving.autoscaling import PREFILL_METRIC, WAITING_METRIC, _replica_values, _track_ages, log, log_scaling
from serving.slo_model import StepModel
from serving.slo_policy import Observation, SloTargets, decide, has_backlog

# What the router reports (router/slo_window.py); Serve averages each over look_back_period_s.
RATE, INPUT, OUTPUT, TTFT_P90, TPOT_P90, SAMPLES, REFUSED, CACHED, LOCAL_RATE, LOCAL_TOKENS = (
    "slo_arrival_rate", "slo_input_tokens", "slo_output_tokens", "slo_ttft_p90", "slo_tpot_p90", "slo_samples",
    "slo_refused_rate", "slo_cached_tokens", "slo_local_prefill_rate", "slo_local_prefill_tokens")
ROUTER_METRICS = (RATE, INPUT, OUTPUT, TTFT_P90, TPOT_P90, SAMPLES, REFUSED, CACHED, LOCAL_RATE, LOCAL_TOKENS)


def observation(router_metrics: dict | None, prefill_metrics: dict | None,
                decode_metrics: dict | None = None) -> Observation | None:
    """The router replicas' window (rates summed, lengths weighted by the arrival rates and the
    local prefills' tokens by their rates, p90s the worst) plus the prefill pool's queued prompt
    tokens and the decode pool's waiting sequences (each summed over replicas); None until a router
    replica has reported."""
    rates = _replica_values(router_metrics, RATE)
    if not rates:
        return None
    total = sum(rates.values())

    def mean(name: str, default: float, weights: dict = rates) -> float:
        values = _replica_values(router_metrics, name)
        whole = sum(weights.values())
        if whole <= 0 or not values:
            return max(values.values(), default=default)
        return sum(values.get(r, default) * weights[r] for r in weights) / whole

    def worst(name: str) -> float | None:
        values = [v for v in _replica_values(router_metrics, name).values() if v > 0]
        return max(values) if values else None

    samples = int(sum(_replica_values(router_metrics, SAMPLES).values()))
    local_rates = _replica_values(router_metrics, LOCAL_RATE)
    return Observation(total, mean(INPUT, 1.0), mean(OUTPUT, 1.0), worst(TTFT_P90), worst(TPOT_P90), samples,
                       sum(_replica_values(prefill_metrics, PREFILL_METRIC).values()),
                       sum(_replica_values(decode_metrics, WAITING_METRIC).values()),
                       sum(_replica_values(router_metrics, REFUSED).values()), mean(CACHED, 0.0),
                       sum(local_rates.values()), mean(LOCAL_TOKENS, 0.0, local_rates))


class SloPolicy:
    """Application-level policy (a class: Serve instantiates it once with `policy_kwargs`)."""

    def __init__(self, model: dict, ttft_slo: float, tpot_slo: float, utilization: float = 0.8,
                 hysteresis: float = 0.2, warmup_s: float = 10.0, window_s: float = 30.0, correction_gain: float = 0.5,
                 prefill_deployment: str = "PrefillServer", decode_deployment: str = "DecodeServer",
                 router_deployment: str = "Router"):
        self.m = StepModel(**model)
        self.t = SloTargets(ttft_slo, tpot_slo, utilization, hysteresis, correction_gain)
        if warmup_s < 0 or window_s <= 0:
            raise ValueError("warmup_s must be >= 0 and window_s > 0")
        self.warmup_s, self.window_s = warmup_s, window_s
        self.names = (prefill_deployment, decode_deployment, router_deployment)

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        if self.names[0] not in by_name or self.names[1] not in by_name:
            return {}, {dep_id: dict(ctx.policy_state or {}) for dep_id, ctx in contexts.items()}
        (pid, pctx), (did, dctx) = by_name[self.names[0]], by_name[self.names[1]]
        rctx = by_name.get(self.names[2], (None, None))[1]
        state = dict(pctx.policy_state or {})
        now = pctx.current_time if pctx.current_time is not None else 0.0
        ages = {"first_seen": state.get("first_seen", {})}
        warming = _track_ages(ages, {f"p/{r}" for r in pctx.running_replicas} | {f"d/{r}" for r in dctx.running_replicas},
                              now, self.warmup_s)
        obs = observation(rctx.aggregated_metrics if rctx else None, pctx.aggregated_metrics, dctx.aggregated_metrics)
        current_p, current_d = max(pctx.current_num_replicas, 1), max(dctx.current_num_replicas, 1)
        if has_backlog(self.m, obs, current_p):
            state["backlog_at"] = now
        quiet = now - state.get("backlog_at", -1e18) > 2 * self.window_s
        d = decide(self.m, self.t, obs, current_p, current_d, tuple(state.get("correction", (1.0, 1.0))),
                   warming, quiet)
        state.update(first_seen=ages["first_seen"], correction=list(d.correction), last_reason=d.reason,
                     predicted_ttft_p90=d.predicted_ttft_p90, predicted_tpot=d.predicted_tpot)

        def bounded(n, ctx):
            return min(max(n, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        states = {dep_id: dict(ctx.policy_state or {}) for dep_id, ctx in contexts.items()}
        states[pid] = state
        held = d.reason if d.reason.startswith("hold: ") else None    # an SLO no count meets: said once
        if held is not None and state.get("held") != held:
            log.warning("pdserve autoscaling (SLO policy): %s", held)
        state["held"] = held
        counts = {pid: bounded(d.prefill, pctx), did: bounded(d.decode, dctx)}
        for dep_id, ctx, wanted in ((pid, pctx, d.prefill), (did, dctx, d.decode)):
            if obs is not None and ctx.current_num_replicas > 0:      # at 0: Serve starting the pool
                log_scaling(states[dep_id], f"{ctx.deployment_name} (SLO policy)", ctx.current_num_replicas,
                            wanted, counts[dep_id], d.reason)
        return counts, states
