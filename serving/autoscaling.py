"""Per-pool autoscaling policies for Ray Serve (torch-free).

Each pool scales on its own signal, reported by its replicas through `record_autoscaling_stats`
(see `serving.engine_host.EngineReplica`) as a fraction of the pool's per-replica target, which
the replicas hold (`serving.config.ScalingTargets`, the deployment's `user_config`; Serve applies
a new one in place, where a policy's own arguments are part of the application's code version and
a change restarts every replica):
  * prefill: queued prompt tokens (queued or mid-prefill) / `target_queued_tokens`;
  * decode: KV-block utilization / `target_kv_utilization` and running sequences /
    `target_running`, each summed over replicas, whichever needs more.
Load is summed, never averaged, so a fresh replica reporting zeros does not dilute it.
Hysteresis: scale up as soon as the load needs more replicas; scale down one replica at a time
and only when the load would still sit below `(1 - hysteresis)` of the target on one replica
fewer, and never while a replica younger than `warmup_s` is present; with no metrics yet, hold.
The result is clamped to the pool's min/max; Serve applies `upscale_delay_s`/`downscale_delay_s`.
Zero (a pool whose `min_replicas` is 0): at zero replicas one starts as soon as a request waits at
a handle (Serve's `total_num_requests`; Serve skips the upscale delay from zero), and a last
replica past its warm-up goes once no request runs on it or waits (after Serve's
`downscale_to_zero_delay_s`). Requests, not load: an idle decode replica's prefix cache still
holds KV.
Each policy writes one line to Serve's controller log (logs/serve/controller_<pid>.log) when it
wants a count other than the pool's current one, with its reason and the bound that clips it
(`log_scaling`), and not again while it wants the same (Serve calls it every ~0.1 s).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from serving.serve_logging import SERVE_LOGGER

log = logging.getLogger(SERVE_LOGGER)     # in Serve's controller, where the policies run: its log file

PREFILL_METRIC = "queued_prompt_tokens"
KV_METRIC = "kv_utilization"
RUNNING_METRIC = "running"
WAITING_METRIC = "waiting"          # sequences queued in the engine (decode: landed, not yet running)
# each a replica's load in replicas: its raw signal over its pool's target (`load_metrics`)
QUEUED_LOAD, KV_LOAD, RUNNING_LOAD = "queued_load", "kv_load", "running_load"


def load_metrics(queued_prompt_tokens: float, kv_utilization: float, running: float, targets) -> dict[str, float]:
    """What a replica reports for the policies below: each signal over its target
    (`targets`: a serving.config.ScalingTargets)."""
    return {QUEUED_LOAD: queued_prompt_tokens / targets.target_queued_tokens,
            KV_LOAD: kv_utilization / targets.target_kv_utilization,
            RUNNING_LOAD: running / targets.target_running}


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


def decide(needed: float, current: int, hysteresis: float, warming: bool) -> Decision:
    """Replicas to ask for, given the load in replica-equivalents (`needed`)."""
    assert current >= 1 and 0 <= hysteresis < 1
    if needed > current:
        return Decision(math.ceil(needed), f"load {needed:.2f} replicas > {current}")
    if current > 1 and not warming and needed <= (current - 1) * (1 - hysteresis):
        return Decision(current - 1, f"load {needed:.2f} replicas fits in {current - 1}")
    return Decision(current, "hold")


def _track_ages(state: dict, replica_ids, now: float, warmup_s: float) -> bool:
    """Remember when each replica was first seen; True while any is younger than warmup_s."""
    first_seen = {rid: t for rid, t in state.get("first_seen", {}).items() if rid in replica_ids}
    for rid in replica_ids:
        first_seen.setdefault(rid, now)
    state["first_seen"] = first_seen
    return any(now - t < warmup_s for t in first_seen.values())


def log_scaling(state: dict, label: str, current: int, wanted: int, bounded: int, reason: str) -> None:
    """One controller-log line when a policy wants `wanted` replicas where `current` run (`bounded`:
    what the pool's min/max leave of it), remembered in `state`: wanting the same change again, also
    after a tick of holding or with another count past the bound, is silent. A change that only
    the bounds make (Serve starting a pool at its min_replicas, a lowered max_replicas) is Serve's,
    not the policy's: not logged."""
    key = [current, bounded]
    if wanted == current or state.get("logged") == key:
        return
    clipped = f" (wants {wanted}: {'max' if wanted > bounded else 'min'}_replicas)" if wanted != bounded else ""
    change = f"stays at {current}" if bounded == current else f"{current} -> {bounded}"
    log.info("pdserve autoscaling %s: %s replicas%s: %s", label, change, clipped, reason)
    state["logged"] = key


def _replica_values(metrics: dict | None, name: str) -> dict[str, float]:
    return {str(rid): float(v) for rid, v in ((metrics or {}).get(name) or {}).items()}


class _PoolPolicy:
    def __init__(self, hysteresis: float = 0.2, warmup_s: float = 10.0):
        if not 0 <= hysteresis < 1 or warmup_s < 0:
            raise ValueError("hysteresis must be in [0, 1) and warmup_s >= 0")
        self.hysteresis, self.warmup_s = hysteresis, warmup_s

    def needed(self, metrics: dict | None) -> float | None:
        """Load in replica-equivalents, or None when no replica has reported."""
        raise NotImplementedError

    def __call__(self, ctx) -> tuple[int, dict]:
        state = dict(ctx.policy_state or {})
        current = ctx.current_num_replicas
        now = ctx.current_time if ctx.current_time is not None else 0.0
        warming = _track_ages(state, {str(r) for r in ctx.running_replicas}, now, self.warmup_s)
        needed = self.needed(ctx.aggregated_metrics)
        requests = ctx.total_num_requests        # running on the replicas and waiting at the handles
        if current == 0:
            decision = Decision(1, f"{requests:g} requests wait at zero replicas") if requests > 0 else \
                Decision(0, "idle at zero replicas")
        elif needed is None:
            decision = Decision(current, "no metrics reported yet")
        else:
            decision = decide(needed, current, self.hysteresis, warming)
            if current == decision.replicas == 1 and ctx.capacity_adjusted_min_replicas == 0 and requests == 0 \
                    and not warming:
                decision = Decision(0, "no request running or waiting")
        state["last_reason"] = decision.reason
        bounded = min(max(decision.replicas, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        log_scaling(state, ctx.deployment_name, current, decision.replicas, bounded, decision.reason)
        return bounded, state


class PrefillPolicy(_PoolPolicy):
    """Prefill pool: queued prompt tokens per replica against its target."""

    def needed(self, metrics) -> float | None:
        queued = _replica_values(metrics, QUEUED_LOAD)
        return sum(queued.values()) if queued else None


class DecodePolicy(_PoolPolicy):
    """Decode pool: KV utilization and running sequences per replica against their targets."""

    def needed(self, metrics) -> float | None:
        kv, running = _replica_values(metrics, KV_LOAD), _replica_values(metrics, RUNNING_LOAD)
        if not kv and not running:
            return None
        return max(sum(kv.values()), sum(running.values()))
